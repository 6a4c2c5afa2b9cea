"""A dllm-serve server as a subprocess of any checkout, and what a client reads of it from outside.

`ServerProcess` runs `scripts/serve_local.py` of a source tree (so the same client can measure an older
checkout and the current one), logs its output stamped with the seconds since the start, records the
cold-start timeline (`wait_ready`: the first 503, the first 200, the ready line, the first completion)
and always ends the server and its Ray (`stop`: SIGTERM, then SIGKILL to its process group).
`gpu_memory_mib` (nvidia-smi; None off-GPU) and `scrape_metrics` (/metrics) are the outside views the
traffic measurement and the GPU soak sample.
"""
from __future__ import annotations

import asyncio
import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
READY_LINE = "dllm-serve is ready"   # what serve_local prints once the weights are loaded
# the metrics of CUDA graphs while serving (None on a server without them)
GRAPH_METRICS = ("dllm_eager_steps_total", "dllm_graph_captures_total", "dllm_kernel_compiles_total",
                 "dllm_cuda_graphs", "dllm_cuda_graph_memory_bytes")
# the runner's step counters: batched forward passes and the rows they carried (passes: absent before it),
# and the seconds rank 0's runner spent executing commands (the rest of a phase's wall is the control plane's)
STEP_METRICS = ("dllm_passes_total", "dllm_forwards_total", "dllm_shard_busy_seconds_total")
SCRAPED = GRAPH_METRICS + STEP_METRICS


class ServerError(RuntimeError):
    """The server did not start, died, or did not answer within its bound; the message ends with the
    last lines of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_commit(tree: Path) -> str | None:
    """The tree's git commit (short, "+dirty" with uncommitted changes); None outside git."""
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


class ServerProcess:
    """`python scripts/serve_local.py model=... port=... ARGS` of `tree`, logged to `log`."""

    def __init__(self, tree: Path, model: str, args: list[str], log: Path, port: int = 0,
                 env: dict[str, str] | None = None):
        """`env`: more environment for the server (and its Ray, which inherits it)."""
        self.tree = Path(tree).resolve()
        self.env = dict(env or {})
        self.script = self.tree / "scripts" / "serve_local.py"
        if not self.script.is_file():
            raise ServerError(f"{self.tree} has no scripts/serve_local.py: not a dllm-serve checkout")
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, str(self.script), f"model={model}", f"port={self.port}", *args]
        self.log_path = Path(log)
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.ready_line_s: float | None = None
        self.proc: subprocess.Popen | None = None
        self.t0 = 0.0

    # ---- the process ------------------------------------------------------------------------------
    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        env.pop("RAY_ADDRESS", None)   # its own local Ray, which stop() ends, never a cluster's
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.tree), os.environ.get("PYTHONPATH")]))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        # its own process group (Ray's processes join it), in this session: ended with us if we are killed
        self.proc = subprocess.Popen(self.command, cwd=self.tree, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                     errors="replace", process_group=0)
        self._reader = threading.Thread(target=self._copy_output, name="server-log", daemon=True)
        self._reader.start()

    def _copy_output(self) -> None:
        with self.log_path.open("w") as log:
            log.write(f"# {datetime.now().astimezone().isoformat(timespec='seconds')} cwd={self.tree}\n"
                      f"# {' '.join(self.command)}\n")
            for line in self.proc.stdout:
                now = time.monotonic() - self.t0
                line = line.rstrip("\n")
                if self.ready_line_s is None and READY_LINE in line:
                    self.ready_line_s = now
                self.tail.append(line)
                log.write(f"{now:9.3f} {datetime.now().strftime('%H:%M:%S.%f')[:-3]} | {line}\n")
                log.flush()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def error(self, message: str) -> ServerError:
        tail = "\n".join(f"  {line}" for line in list(self.tail)[-20:])
        return ServerError(f"{message} (log: {self.log_path}); its last lines:\n{tail}")

    def stop(self, timeout_s: float = 120.0) -> int | None:
        """Ends the server and every process of its group; its exit status (None if it had to be killed)."""
        if self.proc is None:
            return None
        status = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                status = self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        else:
            status = self.proc.returncode
        try:   # Ray's processes of this server, still shutting down or left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(10)
        return status

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- the cold start ---------------------------------------------------------------------------
    async def wait_ready(self, http: httpx.AsyncClient, timeout_s: float, first_body: dict) -> dict:
        """Polls /health until a 200, asks /v1/models for the served model's name, then sends the
        completion `first_body` (its "model" set) until it succeeds (a 503 or no answer is tried again).
        Returns the cold-start timeline in seconds since the start, and "model". Raises ServerError if
        the server dies or `timeout_s` passes first."""
        out = {"first_health_answer_s": None, "first_health_503_s": None, "health_503_message": None,
               "health_200_s": None}
        deadline = self.t0 + timeout_s
        while out["health_200_s"] is None:
            self._check(deadline, "GET /health to answer 200")
            try:
                r = await http.get(f"{self.base}/health", timeout=10)
            except httpx.HTTPError:
                await asyncio.sleep(0.5)
                continue
            now = self.elapsed()
            if out["first_health_answer_s"] is None:
                out["first_health_answer_s"] = now
            if r.status_code == 503 and out["first_health_503_s"] is None:
                out["first_health_503_s"], out["health_503_message"] = now, _error_message(r)
            if r.status_code == 200:
                out["health_200_s"] = now
            else:
                await asyncio.sleep(0.5)
        model = None
        while model is None:
            self._check(deadline, "GET /v1/models to answer 200")
            try:
                r = await http.get(f"{self.base}/v1/models", timeout=30)
                model = r.json()["data"][0]["id"] if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                pass
            if model is None:
                await asyncio.sleep(0.5)
        body = dict(first_body, model=model)
        attempts = 0
        while True:
            self._check(deadline, "a first completion to succeed")
            attempts += 1
            sent = self.elapsed()
            try:
                r = await http.post(f"{self.base}/v1/completions", json=body,
                                    timeout=max(1.0, deadline - time.monotonic()))
            except httpx.HTTPError:
                await asyncio.sleep(1)
                continue
            if r.status_code == 200:
                break
            if r.status_code != 503:
                raise self.error(f"the first completion got HTTP {r.status_code}: {r.text[:300]}")
            await asyncio.sleep(1)
        out |= {"model": model, "first_completion_s": self.elapsed(),
                "first_completion_latency_s": self.elapsed() - sent, "first_completion_attempts": attempts}
        # serve_local prints its ready line after the app runs, so a client can get its answer first
        line_deadline = time.monotonic() + 30
        while self.ready_line_s is None and time.monotonic() < line_deadline and self.alive():
            await asyncio.sleep(0.2)
        out["ready_line_s"] = self.ready_line_s
        return out

    def _check(self, deadline: float, what: str) -> None:
        if not self.alive():
            raise self.error(f"the server exited with status {self.proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise self.error(f"timed out after {deadline - self.t0:.0f} s waiting for {what}")


def _error_message(r: httpx.Response) -> str | None:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200] or None


# ---- outside views -----------------------------------------------------------------------------------

def gpu_memory_mib() -> float | None:
    """Memory used on the GPUs (MiB, summed), from nvidia-smi; None where there is none."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        values = [float(v) for v in r.stdout.split()]
    except ValueError:
        return None
    return sum(values) if r.returncode == 0 and values else None


def parse_metrics(text: str, names=SCRAPED) -> dict[str, float | None]:
    """The named samples of a Prometheus text exposition, summed over their labels; None if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return {name: found.get(name) for name in names}


async def scrape_metrics(http: httpx.AsyncClient, base: str, names=SCRAPED) -> dict[str, float | None]:
    """`parse_metrics` of GET /metrics; every name None if it does not answer 200."""
    try:
        r = await http.get(f"{base}/metrics", timeout=30)
    except httpx.HTTPError:
        return dict.fromkeys(names)
    return parse_metrics(r.text, names) if r.status_code == 200 else dict.fromkeys(names)


def tree_rss_mib(pid: int) -> float | None:
    """Resident memory of a process and all its descendants (Linux /proc), MiB; None elsewhere."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    rss: dict[int, float] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            status = (entry / "status").read_text()
        except OSError:
            continue
        children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry.name))
        kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        rss[int(entry.name)] = kib / 1024
    if pid not in rss:
        return None
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0.0)
        todo += children.get(p, [])
    return total
