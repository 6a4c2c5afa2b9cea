"""Ray + Serve for HTTP tests: one local Ray, one Serve HTTP proxy on a free port, apps by route prefix;
plus what the HTTP, fault, load, fuzz and soak suites share: the coordinator's stats, /health, SSE
reading, the OpenAI error shape, and the resident memory of the app's processes.

The HTTP modules share one Ray + Serve for the whole pytest session (`shared_serve`, stopped when the
session ends): starting and stopping them cost ~11 s a module on 2 cores. Each module deletes its own
apps when it is done (`delete_apps`), so the next one starts from an empty Serve. tests/conftest.py runs
the modules marked `shared_serve` last, so no other test runs beside an idle Ray, and the tests that
start a Ray of their own (test_cluster.py, the `make serve` subprocesses) run before it exists."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator

import httpx
import ray
from ray import serve

# what a client checks, shared with the GPU soak: re-exported for the HTTP tests
from benchmarks.http_checks import assert_openai_error, sse_payloads  # noqa: F401


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(attempts: int = 5, env_vars: dict | None = None) -> int:
    """A local Ray and a Serve proxy on a free port. The port is free when picked but may be taken before
    the proxy binds it (Ray's own workers open ephemeral ports meanwhile): then another port is tried.
    On failure nothing is left running (the next test's ray.init must not find this one's).
    `env_vars` default to one thread a CPU shard; `{}` starts Ray with no runtime env at all (GPU tests:
    the thread count is a CPU knob, and the GPU host's offline Ray may have no runtime-env agent)."""
    env_vars = {"DLLM_SHARD_THREADS": "1"} if env_vars is None else env_vars
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env_vars} if env_vars else None)
    for attempt in range(attempts):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except Exception as err:  # noqa: BLE001 - RayTaskError wrapping the proxy's RuntimeError
            serve.shutdown()
            if "Failed to bind" not in str(err) or attempt == attempts - 1:
                ray.shutdown()
                raise
    raise AssertionError("unreachable")


def stop_serve() -> None:
    serve.shutdown()
    ray.shutdown()


_shared_port: int | None = None


def shared_serve() -> int:
    """The session's Ray + Serve (started by the first caller); its HTTP port."""
    global _shared_port
    if _shared_port is None:
        _shared_port = start_serve()
    return _shared_port


def stop_shared_serve() -> None:
    """Stops the session's Ray + Serve, if one was started (tests/conftest.py, when the session ends)."""
    global _shared_port
    if _shared_port is not None:
        _shared_port = None
        stop_serve()


def delete_apps(timeout_s: float = 60.0) -> None:
    """Deletes every app of the shared Serve, all at once, and waits (bounded) until they are gone. Should
    that fail, the whole Ray + Serve is stopped instead: the next module then starts a fresh one."""
    try:
        for name in serve.status().applications:
            serve.delete(name, _blocking=False)
        wait_until(lambda: not serve.status().applications, timeout_s, "the apps to be deleted", interval_s=0.1)
    except Exception:
        stop_shared_serve()
        raise


@contextlib.contextmanager
def serving(apps: dict[str, object], timeout_s: float = 300.0) -> Iterator[int]:
    """The shared Ray + Serve with each built app under /<name>, deployed side by side (their replicas
    start together); yields the port once every app runs; deletes the apps after."""
    port = shared_serve()
    try:
        for name, app in apps.items():
            serve._run(app, name=name, route_prefix=f"/{name}", _blocking=False)
        wait_running(list(apps), timeout_s)
        yield port
    finally:
        delete_apps()


def wait_running(names: list[str], timeout_s: float) -> None:
    """Until every app named is RUNNING (bounded); an app whose deploy failed fails at once, with Serve's
    message."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications
        for name in names:
            app = status.get(name)
            if app is not None and app.status == "DEPLOY_FAILED":
                raise RuntimeError(f"app {name} failed to deploy: {app.message}")
        if all(name in status and status[name].status == "RUNNING" for name in names):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"apps not running after {timeout_s} s: {_describe(status, names)}")
        time.sleep(0.2)


def _describe(status: dict, names: list[str]) -> dict:
    """Each app's status with each deployment's, its replicas' states and Serve's message (a replica whose
    constructor is still running, one waiting for resources no node has)."""
    return {n: (status[n].status, {d: (ds.status, dict(ds.replica_states), ds.message)
                                   for d, ds in status[n].deployments.items()}) if n in status else "absent"
            for n in names}


def ray_log_tails(patterns: tuple[str, ...] = ("serve/*.log", "runtime_env*.log", "raylet.err", "worker-*.err"),
                  lines: int = 15, files: int = 12) -> str:
    """The last lines of this Ray session's logs matching `patterns` (newest files first): what a replica,
    the runtime-env agent or a worker said while a deployment did not come up."""
    root = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    found = sorted({f for pattern in patterns for f in root.glob(pattern) if f.is_file()},
                   key=lambda f: f.stat().st_mtime, reverse=True)[:files]
    return "\n".join(f"== {f.relative_to(root)}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-lines:])
                     for f in found)


def completions_url(port: int, app: str) -> str:
    return f"http://127.0.0.1:{port}/{app}/v1/completions"


def greedy_choice(port: int, app: str, body: dict) -> dict:
    """The one choice of a completion that must succeed (a probe before and after a disturbance)."""
    import httpx

    r = httpx.post(completions_url(port, app), json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def stats(app: str) -> dict:
    """The coordinator's own counters and slot state (one replica)."""
    return serve.get_deployment_handle("Coordinator", app_name=app).stats.remote().result(timeout_s=30)


def health(port: int, app: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{port}/{app}/health", timeout=30)


def idle_and_healthy(port: int, app: str) -> bool:
    """/health answers 200 and shows every slot free, nothing running or waiting, and no KV page held or
    reserved (each free or cached: none leaked)."""
    r = health(port, app)
    if r.status_code != 200:
        return False
    h = r.json()
    return h["free_slots"] == h["num_slots"] and h["running"] == 0 and h["waiting"] == 0 and h["kv_cache_usage"] == 0


def slow_stream_body(model: str, max_tokens: int = 320, **extra) -> dict:
    """A greedy streamed completion that takes many denoising steps per 32-token block."""
    return {"model": model, "prompt": "slow", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "diffusion": {"policy": "low_confidence", "max_denoising_steps": 32}, **extra}


def raw_stream(url: str, app: str, body: dict) -> tuple[list[dict], list[dict]]:
    """(drafts, data chunks) of one streamed completion of the app at `url` (http://host:port), read as SSE
    lines by hand: drafts ride in SSE comments (deployments/drafts.py)."""
    from deployments.drafts import PREFIX

    drafts, chunks = [], []
    with httpx.stream("POST", f"{url}/{app}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith(PREFIX):
                drafts.append(json.loads(line[len(PREFIX):]))
            elif line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
            else:
                assert line in ("", "data: [DONE]"), line
    return drafts, chunks


def assert_stream_ended_with_error(payloads: list[str]) -> dict:
    """An error after the stream began: one {"error": ...} event, then [DONE], nothing after."""
    assert len(payloads) >= 2 and payloads[-1] == "[DONE]", payloads[-3:]
    return assert_openai_error(json.loads(payloads[-2]), 503)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def app_processes(app: str) -> dict[str, int]:
    """name -> pid of an app's processes: its Serve replicas (titled `ray::ServeReplica:<app>:<name>`,
    found in Linux /proc) and its shard ranks (`shard<rank>`, from the coordinator's stats)."""
    found = {f"shard{rank}": pid for rank, pid in enumerate(stats(app)["shard_pids"])}
    prefix = f"ray::ServeReplica:{app}:"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith(prefix):  # the title ends in the method running, if any: "...:Coordinator.stats"
            found[title[len(prefix):].split()[0].split(".")[0]] = int(proc.name)
    return found


def pid_alive(pid: int) -> bool:
    """False once the process is gone or a zombie (killed, not yet reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_if_alive(pid: int) -> None:
    """Test hygiene for a process this test stopped or killed (a shard of its own Ray)."""
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
