"""The app on a simulated multi-node Ray cluster (ray.cluster_utils.Cluster: a head and two worker nodes on
this machine, 2 CPUs each, no GPU; a test may add a node for its own use, one that declares 2 GPUs or a
spare it then removes): the device and the placement come from the cluster, not the node that builds the
app; a placement the cluster can never hold fails the deploy, one it cannot hold now fails the replica's
start after placement_timeout_s while /health says what is missing; a PACK replica spans nodes and
answers like TP=1; the real `serve deploy` CLI deploys serve_config.yaml; Ray's metrics cover every
replica; load scales the replicas and back (reliability); a lost node ends in errors within bounds
(reliability); `make serve` stops on Ctrl-C while its placement is pending. One cluster for the module:
starting one takes about 10 s."""
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.cluster_utils import Cluster
from ray.serve._private.build_app import build_app as serve_build_app
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from deployments.app import build_app
from model.sampling.params import DecodeParams
from tests.serve_harness import (assert_openai_error, assert_stream_ended_with_error, free_port, slow_stream_body,
                                 sse_payloads, wait_until)
from workers.engine import Engine

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"
NODE_CPUS = 2
ROUNDS = 5   # of eight requests at once, until both replicas of test_ray_metrics_cover_every_replica served some


@pytest.fixture(scope="module")
def cluster():
    """A head and two worker nodes, each with its own Ray metrics endpoint; Serve's proxy on the head only
    (every node's proxy would bind the same port of this one machine)."""
    metrics_ports = [free_port() for _ in range(3)]
    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=NODE_CPUS, include_dashboard=True, dashboard_port=free_port(), metrics_export_port=metrics_ports[0],
        _system_config={"metrics_report_interval_ms": 1000}))
    # Cluster records its address as this machine's current Ray cluster, where a bare `ray.init()` (any other
    # test session on this machine) would connect: only explicit addresses reach this one.
    address_file = Path(ray._private.utils.get_ray_address_file(None))
    if address_file.exists() and address_file.read_text().strip() == c.address:
        address_file.unlink()
    try:
        for port in metrics_ports[1:]:
            c.add_node(num_cpus=NODE_CPUS, metrics_export_port=port)
        c.wait_for_nodes(timeout=60)
        ray.init(address=c.address, log_to_driver=False, runtime_env={"env_vars": {"DLLM_SHARD_THREADS": "1"}})
        http_port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": http_port})
        c.http_port, c.metrics_ports = http_port, metrics_ports
        yield c
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        c.shutdown()


def base(cluster, app: str) -> str:
    return f"http://127.0.0.1:{cluster.http_port}/{app}"


def node_ids() -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n["Alive"]]


def replica_groups(app: str) -> list[dict]:
    """The placement groups Serve made for an app's Coordinator replicas (named as the replicas)."""
    return [g for g in placement_group_table().values()
            if g["name"].startswith(f"SERVE_REPLICA::{app}#Coordinator#") and g["state"] != "REMOVED"]


@ray.remote(num_cpus=1)
class Blocker:
    """Holds a CPU of one node, as another tenant of the cluster would."""

    def ready(self) -> bool:
        return True


def hold_one_cpu_per_node() -> list:
    blockers = [Blocker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                for node in node_ids()]
    ray.get([b.ready.remote() for b in blockers], timeout=60)
    return blockers


# ---------------------------------------------------------------------------------- item 1: device


@ray.remote(num_cpus=0)
def built_on_this_node(args: dict) -> dict:
    """What `serve deploy` does on the cluster (a Ray task on any node, here the CPU-only head): build the
    app; returns the coordinator's placement and the shards' device and dtype."""
    built = serve_build_app(build_app(args), name="built")
    coordinator = next(d for d in built.deployments if d.name == "Coordinator")
    runner_args = coordinator.init_args[0]
    return {"bundles": coordinator._replica_config.placement_group_bundles, "device": runner_args.device,
            "dtype": runner_args.dtype, "shard": coordinator.init_args[2]}


@pytest.fixture
def gpu_node(cluster):
    node = cluster.add_node(num_cpus=NODE_CPUS, num_gpus=2)
    wait_until(lambda: ray.cluster_resources().get("GPU") == 2, 60, "the GPU node to join")
    try:
        yield node
    finally:
        cluster.remove_node(node)
        wait_until(lambda: "GPU" not in ray.cluster_resources(), 60, "the GPU node to leave")


def test_device_auto_takes_the_gpus_of_a_worker_node(cluster, gpu_node, tiny_nemotron):
    head = cluster.head_node.node_id
    on_head = built_on_this_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False))
    got = ray.get(on_head.remote({"model": str(tiny_nemotron), "tensor_parallel_size": 2}), timeout=120)
    assert got == {"bundles": [{"CPU": 1}, {"GPU": 1}, {"GPU": 1}], "device": "cuda", "dtype": "bfloat16",
                   "shard": {"GPU": 1}}, got
    assert ray.get(on_head.remote({"model": str(tiny_nemotron), "device": "cpu"}), timeout=120)["dtype"] is None
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 on device=cuda cannot be placed: STRICT_PACK "
                                         r"placement of \[\{'CPU': 1\}, \{'GPU': 1\}, \{'GPU': 1\}, \{'GPU': 1\}, "
                                         r"\{'GPU': 1\}\]: all on one node \(\{CPU: 1, GPU: 4\} on one node\), and "
                                         r"the Ray cluster at .* has 4 node\(s\):.*\{CPU: 2, GPU: 2\}"):
        build_app({"model": str(tiny_nemotron), "tensor_parallel_size": 4})


def test_device_cuda_without_a_gpu_in_the_cluster_fails_the_deploy(cluster, tiny_nemotron):
    with pytest.raises(ValueError, match=r"device=cuda, but the Ray cluster at .* has 3 node\(s\): \{CPU: 2\}; "
                                         r"\{CPU: 2\}; \{CPU: 2\}: no GPU"):
        build_app({"model": str(tiny_nemotron), "device": "cuda"})
    assert ray.get(built_on_this_node.remote({"model": str(tiny_nemotron)}), timeout=120)["device"] == "cpu"


# ------------------------------------------------------------------------------- item 2: placement


def test_a_placement_no_node_can_hold_fails_the_deploy(cluster, tiny_nemotron):
    """TP=2 on CPUs asks 3 CPUs on one node (STRICT_PACK); no node has more than 2. Half-CPU shards fit."""
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 on device=cpu cannot be placed: STRICT_PACK "
                                         r".*\{CPU: 3\} on one node.*shard_cpus=0.5"):
        build_app({"model": str(tiny_nemotron), "tensor_parallel_size": 2})
    build_app({"model": str(tiny_nemotron), "tensor_parallel_size": 2, "shard_cpus": 0.5})
    with pytest.raises(ValueError, match=r"STRICT_PACK placement of \[\{'CPU': 1\}, \{'CPU': 1.0\}\] 4 times "
                                         r"\(the replicas Serve starts with\)"):
        build_app({"model": str(tiny_nemotron), "num_replicas": 4})


def test_pending_placement_is_reported_then_fails_the_replica(cluster, tiny_nemotron):
    """Every node has 1 CPU free (another tenant holds the other), a replica asks 2 on one node: /health
    says what is missing within its bound, and after placement_timeout_s the replica's start fails (3
    failed starts: the deployment is DEPLOY_FAILED), with the reason on /health."""
    blockers = hold_one_cpu_per_node()
    # the ingress's watch counts it from its first sight of a pending group, so each of the 3 starts is pending
    # at least this long once /health can say so, however slowly the ingress came up (4 s: 3 x 2 s more)
    timeout_s = 2
    try:
        app = build_app({"model": str(tiny_nemotron), "served_model_name": MODEL, "placement_timeout_s": timeout_s,
                         "drain_timeout_s": 1})
        serve._run(app, name="pending", route_prefix="/pending", _blocking=False)
        deployed = time.monotonic()
        wait_until(lambda: serve.status().applications["pending"].deployments["OpenAIIngress"].status == "HEALTHY",
                   60, "the ingress to run")

        def health() -> httpx.Response:
            start = time.monotonic()
            r = httpx.get(f"{base(cluster, 'pending')}/health", timeout=10)
            assert time.monotonic() - start < 5, "a /health answer took longer than its bound"
            return r

        def reason(r) -> str:
            assert r.status_code == 503, r.text
            return assert_openai_error(r.json(), 503)["message"]

        pending = wait_until(lambda: "pending placement" in reason(r := health()) and r, 30,
                             "/health to say the placement is pending")
        assert ("tensor_parallel_size=1 asks [{'CPU': 1.0}, {'CPU': 1.0}] (STRICT_PACK); missing: {CPU: 1} more on "
                f"one node (the most free on one node: {{CPU: 1}}); it fails after placement_timeout_s={timeout_s}") \
            in reason(pending), reason(pending)
        wait_until(lambda: serve.status().applications["pending"].status == "DEPLOY_FAILED", 60,
                   "the deployment to fail")
        # 3 starts of timeout_s each, Serve's retries and the polls (45 s when they were 4 s each)
        assert time.monotonic() - deployed < 39
        failed = reason(health())
        assert failed.startswith("Deployment(name='Coordinator', app='pending') is unavailable because it failed to "
                                 "deploy. placement failed: a model replica's start was failed (Serve retries it) "
                                 f"because its placement group was still pending after placement_timeout_s={timeout_s}"
                                 ), failed
        assert not replica_groups("pending")
    finally:
        serve.delete("pending")
        for b in blockers:
            ray.kill(b)


# ----------------------------------------------------------------------------------- item 4: nodes


def tp1_reference(model_dir, prompt: list[int], params: DecodeParams) -> tuple[list[int], list[float]]:
    """Tokens and logprobs of the in-process engine at TP=1 (no Ray)."""
    with Engine(str(model_dir), tp=1, num_slots=1, max_model_len=256) as engine:
        request, logprobs, deadline = engine.add(prompt, params), [], time.monotonic() + 120
        while not request.finished:
            assert time.monotonic() < deadline
            for out in engine.step():
                logprobs += out.new_logprobs or []
    return request.output, logprobs


def test_pack_replica_spans_two_nodes_and_answers_like_tp1(cluster, tiny_nemotron):
    """Shards of 1.5 CPUs on nodes of 2: PACK must put the two on different nodes."""
    app = build_app({"model": str(tiny_nemotron), "served_model_name": MODEL, "tensor_parallel_size": 2,
                     "placement_strategy": "PACK", "shard_cpus": 1.5, "max_model_len": 256})
    serve.run(app, name="pack", route_prefix="/pack")
    try:
        (group,) = replica_groups("pack")
        nodes = group["bundles_to_node_id"]
        assert nodes[1] != nodes[2], nodes
        prompt, params = [5, 9, 14, 3], DecodeParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=1)
        handle = serve.get_deployment_handle("Coordinator", app_name="pack")
        outputs = [item["output"] for item in handle.options(stream=True).generate.remote(prompt, params, "x")]
        tokens = [t for out in outputs for t in out.new_tokens]
        logprobs = [x for out in outputs for x in (out.new_logprobs or [])]
        ref_tokens, ref_logprobs = tp1_reference(tiny_nemotron, prompt, params)
        assert tokens == ref_tokens and len(tokens) == 64
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)
        r = httpx.post(f"{base(cluster, 'pack')}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True, "logprobs": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["token_logprobs"] == \
            pytest.approx(logprobs, abs=1e-6)
    finally:
        serve.delete("pack")


def test_serve_deploy_of_serve_config_yaml(cluster, tiny_nemotron, tmp_path):
    """The real CLI: `serve deploy serve_config.yaml --address <dashboard>`, `serve status`, a request. The
    config is the shipped one but for what one machine needs: the checkpoint, and one HTTP proxy on a free
    port (a proxy per node would bind the same port of this machine)."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config.update(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": cluster.http_port})
    (app,) = config["applications"]
    app["args"]["model"] = str(tiny_nemotron)
    (tmp_path / "serve_config.yaml").write_text(yaml.safe_dump(config))
    address = f"http://{cluster.webui_url}"
    serve_cli = str(Path(sys.executable).with_name("serve"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def cli(*args: str) -> str:
        done = subprocess.run([serve_cli, *args, "--address", address], capture_output=True, text=True, timeout=120,
                              cwd=ROOT, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    try:
        cli("deploy", str(tmp_path / "serve_config.yaml"))
        # waited for through the API: a `serve status` a poll (a CLI process, ~1.5 s of a core) slowed the deploy
        wait_until(lambda: getattr(serve.status().applications.get("dllm"), "status", None) == "RUNNING", 120,
                   "dllm to run")
        status = wait_until(lambda: (s := yaml.safe_load(cli("status"))["applications"].get("dllm", {}))
                            .get("status") == "RUNNING" and s, 120, "`serve status` to show dllm RUNNING")
        assert status["deployments"]["Coordinator"]["status"] == "HEALTHY", status
        r = httpx.post(f"http://127.0.0.1:{cluster.http_port}/v1/completions", timeout=60,
                       json={"model": tiny_nemotron.name, "prompt": "Hello", "max_tokens": 8})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
    finally:
        serve.delete("dllm")


@pytest.mark.reliability
def test_a_lost_node_ends_in_errors_within_bounds_then_recovers(cluster, tiny_nemotron):
    """A node holding a replica's shard dies while a request streams. Every other node has 1 CPU free, so
    the shard's 1.5-CPU bundle can be placed nowhere else: the stream ends with an error event, the
    rebuild gives up after placement_timeout_s (state down), Serve replaces the replica, whose new group
    waits and fails by the same bound; /health says which at every step within its own bound, and once
    the CPUs are free again a replica runs and answers as before."""
    blockers = hold_one_cpu_per_node()
    app = build_app({"model": str(tiny_nemotron), "served_model_name": MODEL, "placement_strategy": "PACK",
                     "shard_cpus": 1.5, "placement_timeout_s": 15, "drain_timeout_s": 1, "max_model_len": 2048})
    serve._run(app, name="lost", route_prefix="/lost", _blocking=False)
    spare = None
    try:
        # the spare node joins once the ingress runs elsewhere, so that only the replica's group lands on it
        wait_until(lambda: serve.status().applications["lost"].deployments["OpenAIIngress"].status == "HEALTHY",
                   60, "the ingress to run")
        spare = cluster.add_node(num_cpus=NODE_CPUS)
        wait_until(lambda: serve.status().applications["lost"].status == "RUNNING", 60, "the replica to run")
        (group,) = replica_groups("lost")
        assert group["bundles_to_node_id"][1] == spare.node_id != group["bundles_to_node_id"][0]
        body = {"model": MODEL, "prompt": "lost", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        before = httpx.post(f"{base(cluster, 'lost')}/v1/completions", json=body, timeout=60).json()
        first_block = threading.Event()

        def stream() -> tuple[list[str], float]:
            with httpx.stream("POST", f"{base(cluster, 'lost')}/v1/completions", timeout=120,
                              json=slow_stream_body(MODEL, 1600)) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    first_block.set()
            return sse_payloads(lines), time.monotonic()

        with ThreadPoolExecutor(1) as pool:
            streamed = pool.submit(stream)
            assert first_block.wait(60)
            cluster.remove_node(spare)
            lost_at = time.monotonic()
            payloads, ended = streamed.result(timeout=90)
        assert_stream_ended_with_error(payloads)
        assert ended - lost_at < 30
        seen: list[str] = []   # /health's reasons in turn: rebuilding, down, then a new replica's placement
        for _ in range(90):
            start = time.monotonic()
            h = httpx.get(f"{base(cluster, 'lost')}/health", timeout=10)
            assert time.monotonic() - start < 5 and h.status_code == 503, h.text
            reason = h.json()["error"]["message"].split(":")[0]
            seen += [reason] if not seen or seen[-1] != reason else []
            if reason in ("pending placement", "placement failed"):
                break
            time.sleep(1)
        print("/health after the loss:", seen)
        assert seen[0] == "rebuilding the model shards after a failure" and \
            seen[-1] in ("pending placement", "placement failed"), seen
        for b in blockers:
            ray.kill(b)
        blockers = []
        wait_until(lambda: httpx.get(f"{base(cluster, 'lost')}/health", timeout=10).status_code == 200, 120,
                   "a replica to run again")
        after = httpx.post(f"{base(cluster, 'lost')}/v1/completions", json=body, timeout=60).json()
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
    finally:
        serve.delete("lost")
        for b in blockers:
            ray.kill(b)


# ------------------------------------------------------------------------------ item 3: replicas


def ray_samples(cluster, name: str) -> list:
    """Samples of one series from every node's Ray metrics endpoint (what Prometheus scrapes)."""
    found = []
    for port in cluster.metrics_ports:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        found += [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    return found


def test_ray_metrics_cover_every_replica(cluster, tiny_nemotron):
    """Two replicas on two nodes: Ray's metrics carry both (their slots, and tokens that add up to every
    answer's), where the ingress's /metrics shows one replica's. Requests are sent eight at a time until
    both replicas have served some, bounded (ROUNDS), not assumed. A round's eight prompts differ: the
    prefix router sends a prompt to the replica that holds it, and places a cold one by hashing it, so
    one prompt sent eight times stays on one replica until its queue is past the router's imbalance (a
    loaded CI machine saw all 40 of five rounds go to one)."""
    app = build_app({"model": str(tiny_nemotron), "served_model_name": MODEL, "num_replicas": 2, "max_num_seqs": 4,
                     "max_model_len": 256})
    serve.run(app, name="replicas", route_prefix="/replicas")
    try:
        def body(i: int) -> dict:
            return {"model": MODEL, "prompt": f"every replica {i}", "max_tokens": 64, "temperature": 0,
                    "ignore_eos": True}

        def per_replica(name: str) -> dict[str, float]:
            return {s.labels["replica"]: s.value for s in ray_samples(cluster, name)
                    if s.labels.get("application") == "replicas" and s.labels.get("deployment") == "Coordinator"}

        def requests_total() -> float:
            return sum(s.value for s in ray_samples(cluster, "ray_dllm_requests_total")
                       if s.labels.get("application") == "replicas")

        answers: list[httpx.Response] = []
        for _ in range(ROUNDS):
            with ThreadPoolExecutor(8) as pool:
                answers += pool.map(lambda i: httpx.post(f"{base(cluster, 'replicas')}/v1/completions", json=body(i),
                                                         timeout=120), range(8))
            assert all(r.status_code == 200 for r in answers)   # before waiting for metrics of failed requests
            # the ingress's request count too, exported on its own cadence: one wait for both, not two in turn
            tokens = wait_until(lambda: sum((t := per_replica("ray_dllm_committed_tokens_total")).values())
                                == len(answers) * 64 and requests_total() == len(answers) and t, 30,
                                "every answer's tokens and the ingress's request count in Ray's metrics")
            if len(tokens) == 2:
                break
        texts = [r.json()["choices"][0]["text"] for r in answers]   # a prompt's answer, wherever it ran
        assert all(t == texts[k % 8] for k, t in enumerate(texts))
        assert len(tokens) == 2 and all(n > 0 for n in tokens.values()), (len(answers), tokens)
        assert set(per_replica("ray_dllm_num_slots").values()) == {4.0} and len(per_replica("ray_dllm_num_slots")) == 2
        assert requests_total() == len(answers)   # the ingress's request count in Ray's metrics
        one = httpx.get(f"{base(cluster, 'replicas')}/metrics", timeout=30).text   # one replica's view
        committed = [s.value for f in text_string_to_metric_families(one) for s in f.samples
                     if s.name == "dllm_committed_tokens_total"]
        assert committed and committed[0] in tokens.values()
    finally:
        serve.delete("replicas")


def running_replicas(app: str) -> int:
    return serve.status().applications[app].deployments["Coordinator"].replica_states.get("RUNNING", 0)


@pytest.mark.reliability
def test_load_scales_the_coordinator_to_two_replicas_and_back(cluster, tiny_nemotron):
    """autoscaling_config: six clients sending back to back hold ~6 requests at one replica whose target is
    2, so Serve starts a second; when they stop, it goes back to one. Every answer (the same greedy request)
    is the same text, before, during and after, and none fails."""
    scaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 0,
               "downscale_delay_s": 2, "metrics_interval_s": 0.5, "look_back_period_s": 2}
    app = build_app({"model": str(tiny_nemotron), "served_model_name": MODEL, "max_num_seqs": 4, "max_model_len": 256,
                     "autoscaling_config": scaling})
    serve.run(app, name="scaling", route_prefix="/scaling")
    body = {"model": MODEL, "prompt": "scale", "max_tokens": 96, "temperature": 0, "ignore_eos": True,
            "diffusion": {"policy": "low_confidence", "max_denoising_steps": 32}}

    def ask() -> httpx.Response:
        return httpx.post(f"{base(cluster, 'scaling')}/v1/completions", json=body, timeout=120)

    try:
        assert running_replicas("scaling") == 1
        expected = ask().json()["choices"][0]["text"]
        answers, done = [], threading.Event()
        scaled_at: list[int] = []

        def client() -> None:
            while not done.is_set():
                answers.append(ask())
                if scaled_at and len(answers) >= scaled_at[0] + 12:   # the second replica has had its share
                    done.set()

        with ThreadPoolExecutor(6) as pool:
            for _ in range(6):
                pool.submit(client)
            wait_until(lambda: running_replicas("scaling") == 2, 120, "a second replica")
            scaled_at.append(len(answers))
            assert done.wait(120), "the clients did not finish"
        tokens = wait_until(lambda: len(t := {s.labels["replica"]: s.value for s in ray_samples(
            cluster, "ray_dllm_committed_tokens_total") if s.labels.get("application") == "scaling"}) == 2 and t,
            30, "both replicas' tokens in Ray's metrics")
        assert all(n > 0 for n in tokens.values()), tokens   # the second replica served its share
        wait_until(lambda: running_replicas("scaling") == 1 and len(replica_groups("scaling")) == 1, 90,
                   "the coordinator back to one replica")
        assert [r.status_code for r in answers] == [200] * len(answers)
        assert {r.json()["choices"][0]["text"] for r in answers} == {expected}
        assert all(r.json()["usage"]["completion_tokens"] == 96 for r in answers)
        assert ask().json()["choices"][0]["text"] == expected
    finally:
        serve.delete("scaling")


# --------------------------------------------------------------------- item 2: `make serve` stops


def test_make_serve_stops_on_ctrl_c_while_its_placement_is_pending(cluster, tiny_nemotron, tmp_path):
    """scripts/serve_local.py against this cluster (RAY_ADDRESS) while every node has 1 CPU free and the
    replica asks 2 on one node: Ctrl-C (SIGINT to its process group, as a terminal sends it) ends it within
    the bound, with nothing of its app left. Last in the module: it shuts Serve down, as `make serve` does."""
    blockers = hold_one_cpu_per_node()
    log = tmp_path / "serve_local.log"
    env = {**os.environ, "RAY_ADDRESS": cluster.address,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "serve_local.py"), f"model={tiny_nemotron}",
                                 "drain_timeout_s=2"], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    try:
        wait_until(lambda: any(g["state"] == "PENDING" for g in replica_groups("dllm")), 90,
                   "serve_local's replica to wait for its placement")
        os.killpg(proc.pid, signal.SIGINT)
        stopped = time.monotonic()
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert time.monotonic() - stopped < 45
        assert "stopping dllm-serve" in log.read_text()
        wait_until(lambda: not replica_groups("dllm"), 30, "the replica's placement group to go")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for b in blockers:
            ray.kill(b)
