"""The app on a simulated multi-node Ray cluster (ray.cluster_utils.Cluster: a head and two worker nodes on
this machine, 2 CPUs each, no GPU; one test adds a node that declares 2 GPUs): the device and the
placement come from the cluster, not the node that builds the app; a placement the cluster can never
hold fails the deploy, one it cannot hold now fails the replica's start after placement_timeout_s while
/health says what is missing; a PACK replica spans nodes and answers like TP=1; the real `serve deploy`
CLI deploys serve_config.yaml; Ray's metrics cover every replica; `make serve` stops on Ctrl-C while its
placement is pending. One cluster for the module: starting one takes about 10 s."""
import os
import signal
import subprocess
import sys
import time
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
from tests.serve_harness import assert_openai_error, free_port, wait_until
from workers.engine import Engine

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"
NODE_CPUS = 2


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
                                         r"\(num_replicas\)"):
        build_app({"model": str(tiny_nemotron), "num_replicas": 4})


def test_pending_placement_is_reported_then_fails_the_replica(cluster, tiny_nemotron):
    """Every node has 1 CPU free (another tenant holds the other), a replica asks 2 on one node: /health
    says what is missing within its bound, and after placement_timeout_s the replica's start fails (3
    failed starts: the deployment is DEPLOY_FAILED), with the reason on /health."""
    blockers = hold_one_cpu_per_node()
    try:
        app = build_app({"model": str(tiny_nemotron), "served_model_name": MODEL, "placement_timeout_s": 4,
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
                "one node (the most free on one node: {CPU: 1}); it fails after placement_timeout_s=4") \
            in reason(pending), reason(pending)
        wait_until(lambda: serve.status().applications["pending"].status == "DEPLOY_FAILED", 60,
                   "the deployment to fail")
        assert time.monotonic() - deployed < 45   # 3 starts of 4 s each, Serve's retries and the polls
        failed = reason(health())
        assert failed.startswith("Deployment(name='Coordinator', app='pending') is unavailable because it failed to "
                                 "deploy. placement failed: a model replica's start was failed (Serve retries it) "
                                 "because its placement group was still pending after placement_timeout_s=4"), failed
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
