"""`build_app(args)`: the application for `serve run` / `serve deploy`.

    serve run deployments.app:build_app model=DIR tensor_parallel_size=N

The checkpoint is read once here and handed to the ingress (deployments/ingress.py) and, with the
runner's arguments, to every coordinator replica and its shards (workers/serve_coordinator.py).
"""
from __future__ import annotations

import ray
from ray.serve.config import RequestRouterConfig

from deployments.args import BATCH_INVARIANT_NEEDS_CUDA, AppArgs
from deployments.cluster import ClusterResources, resolve_device
from deployments.ingress import OpenAIIngress
from deployments.placement import never_placed
from model.checkpoint import Checkpoint, RunnerArgs
from model.protocol import PAGE_SIZE
from workers.prefix_router import PrefixAffinityRouter
from workers.serve_coordinator import REPLICA_BUNDLE, CoordinatorDeployment, placement_bundles, shard_bundle

# how often each replica reports its cache to the routers (Serve's default is 10 s; a conversation's next
# turn comes sooner, and the routers remember what they sent meanwhile)
ROUTING_STATS_S = 2.0


def build_app(args: dict):
    """The application for `serve run deployments.app:build_app key=value ...`: the checkpoint read once
    here, and handed to the ingress and, with the runner's arguments, to every replica and shard.

    The device and the placement come from the cluster this process is connected to (`serve deploy` and
    `serve run serve_config.yaml` build on the cluster, scripts/serve_local.py after `ray.init`); not
    connected (`serve run module:build_app ...` builds first), `device: auto` reads this machine's GPUs
    and the placement is checked by the ingress once deployed (deployments/placement.py)."""
    a = AppArgs(**args)
    model_dir = a.model_dir()
    cluster = ClusterResources.read() if ray.is_initialized() else ClusterResources.this_machine()
    device = resolve_device(a.device, cluster)
    if a.batch_invariant and device != "cuda":
        raise ValueError(f"{BATCH_INVARIANT_NEEDS_CUDA}; {cluster.describe()}")
    use_gpu = device == "cuda"
    bundles = placement_bundles(a.tensor_parallel_size, use_gpu, a.shard_cpus)
    if ray.is_initialized():   # the cluster can ever hold the replicas Serve starts with, or the deploy fails now
        problem = never_placed(a, device, bundles, cluster)
        if problem is not None:
            raise ValueError(problem)
    checkpoint = Checkpoint.read(model_dir)
    checkpoint.config.check_tensor_parallel(a.tensor_parallel_size)  # fail at deploy, not at request
    checkpoint.check_quantization(a.quantization)
    runner_args = RunnerArgs(checkpoint=checkpoint, num_slots=a.max_num_seqs, max_model_len=a.max_model_len,
                             dtype=a.torch_dtype(device), device=device, load_format=a.load_format,
                             max_steps_per_command=a.max_steps_per_command, batch_invariant=a.batch_invariant,
                             kv_cache_tokens=a.kv_cache_tokens, gpu_memory_utilization=a.gpu_memory_utilization,
                             prefill_chunk=a.prefill_chunk_tokens)
    engine_args = a.engine_args() | {"cache_salt": checkpoint.cache_salt(a.torch_dtype(device))}
    scaling = {"num_replicas": a.num_replicas or 1} if a.autoscaling_config is None else \
        {"autoscaling_config": a.autoscaling_config}
    if a.enable_prefix_caching and a.prefix_routing:   # routing that follows each replica's cache
        scaling["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRouter, request_routing_stats_period_s=ROUTING_STATS_S,
            request_router_kwargs={"page_size": PAGE_SIZE, "salt": engine_args["cache_salt"].decode(),
                                   "imbalance": a.max_num_seqs})
    coordinator = CoordinatorDeployment.options(
        **scaling, placement_group_bundles=bundles, placement_group_strategy=a.placement_strategy,
        ray_actor_options={"num_cpus": REPLICA_BUNDLE["CPU"]},
        graceful_shutdown_timeout_s=a.drain_timeout_s,
    ).bind(runner_args, a.tensor_parallel_size, shard_bundle(use_gpu, a.shard_cpus), engine_args, a.command_timeout_s,
           a.placement_timeout_s, a.model_name())
    return OpenAIIngress.bind(coordinator, {**a.model_dump(), "model": model_dir, "device": device}, checkpoint)
