"""Whether a cluster can ever hold a model replica's placement group (deployments/cluster.py), and what
/health says is missing while one waits (deployments/placement.py): pure functions over resource dicts,
without Ray. The same checks against a simulated Ray cluster: tests/test_cluster.py."""
import pydantic
import pytest

from deployments.args import AppArgs
from deployments.cluster import ClusterResources, fits, resolve_device, unplaceable
from deployments.placement import missing, never_placed
from workers.serve_coordinator import placement_bundles

CPU_NODE, GPU_NODE = {"CPU": 8}, {"CPU": 192, "GPU": 8}


def test_strategies():
    two = [{"CPU": 1}, {"CPU": 1}]
    assert fits([two], "STRICT_PACK", [{"CPU": 2}]) and not fits([two], "STRICT_PACK", [{"CPU": 1}, {"CPU": 1}])
    assert fits([two], "PACK", [{"CPU": 1}, {"CPU": 1}]) and fits([two], "SPREAD", [{"CPU": 1}, {"CPU": 1}])
    assert fits([two], "STRICT_SPREAD", [{"CPU": 2}, {"CPU": 2}]) and not fits([two], "STRICT_SPREAD", [{"CPU": 4}])
    assert not fits([two, two], "STRICT_PACK", [{"CPU": 3}, {"CPU": 1}])   # each group whole on one node
    assert fits([two, two], "STRICT_PACK", [{"CPU": 2}, {"CPU": 2}])
    # a bundle is indivisible: 1.5 + 1.5 do not fit two nodes of 1 and 2 CPUs though the total (3) does
    assert not fits([[{"CPU": 1.5}, {"CPU": 1.5}]], "PACK", [{"CPU": 1}, {"CPU": 2}])
    # first fit by size would put 2 on the 3-CPU node and fail; the search finds 3+1 / 2+2
    assert fits([[{"CPU": 2}, {"CPU": 2}, {"CPU": 2}, {"CPU": 1}, {"CPU": 1}]], "PACK", [{"CPU": 4}, {"CPU": 4}])
    assert fits([[{"CPU": 0.5}] * 4], "STRICT_PACK", [{"CPU": 2}])   # fractions add up exactly


def test_gpus_on_a_cpu_head_cluster():
    """The shipped cluster.yaml: a CPU head and 8-GPU workers. STRICT_PACK keeps a replica on one GPU node."""
    cluster = ClusterResources(({"CPU": 8, "GPU": 0}, GPU_NODE))
    assert resolve_device("auto", cluster) == "cuda" and resolve_device("cpu", cluster) == "cpu"
    assert unplaceable(placement_bundles(8, True), "STRICT_PACK", 1, cluster) is None
    problem = unplaceable(placement_bundles(16, True), "STRICT_PACK", 1, cluster)
    assert "GPU: 16" in problem and "{CPU: 192, GPU: 8}" in problem, problem
    assert unplaceable(placement_bundles(16, True), "PACK", 1, ClusterResources((GPU_NODE, GPU_NODE))) is None
    assert unplaceable(placement_bundles(4, True), "STRICT_PACK", 2, cluster) is None       # two replicas of 4
    assert "2 times" in unplaceable(placement_bundles(8, True), "STRICT_PACK", 2, cluster)   # but not of 8


def test_nodes_an_autoscaler_may_add_count():
    """Before any GPU node runs, an autoscaler that reports its node types can still start one."""
    head_only = ClusterResources(({"CPU": 8},), launchable=((GPU_NODE, 4),))
    assert resolve_device("auto", head_only) == "cuda"
    assert unplaceable(placement_bundles(8, True), "STRICT_PACK", 4, head_only) is None
    assert unplaceable(placement_bundles(8, True), "STRICT_PACK", 5, head_only) is not None


def test_cuda_without_a_gpu_is_an_error():
    cluster = ClusterResources(({"CPU": 2},), where="the Ray cluster at 10.0.0.1:6379")
    assert resolve_device("auto", cluster) == "cpu"
    with pytest.raises(ValueError, match=r"device=cuda, but the Ray cluster at 10.0.0.1:6379 has 1 node\(s\): "
                                         r"\{CPU: 2\}: no GPU"):
        resolve_device("cuda", cluster)


def test_the_deploy_error_names_tp_bundles_and_the_cluster():
    """The issue's case: TP=2 on a 2-core machine asks 3 CPUs; fractional shards make it fit."""
    machine = ClusterResources(({"CPU": 2},), where="this machine")
    args = AppArgs(tensor_parallel_size=2, device="cpu")
    problem = never_placed(args, "cpu", placement_bundles(2, False), machine)
    assert problem.startswith("tensor_parallel_size=2 on device=cpu cannot be placed: STRICT_PACK placement of "
                              "[{'CPU': 1}, {'CPU': 1.0}, {'CPU': 1.0}]: all on one node ({CPU: 3} on one node), "
                              "and this machine has 1 node(s): {CPU: 2}"), problem
    assert "shard_cpus=0.5" in problem
    assert never_placed(args, "cpu", placement_bundles(2, False, 0.5), machine) is None


def test_what_is_missing():
    bundles = [{"CPU": 1}, {"CPU": 1}]
    assert missing(bundles, "STRICT_PACK", [{"CPU": 1}, {"CPU": 0}]) == \
        "{CPU: 1} more on one node (the most free on one node: {CPU: 1})"
    assert missing(bundles, "PACK", [{"CPU": 0.5}]) == "{CPU: 1.5} more in the cluster"
    assert missing([{"CPU": 1}, {"GPU": 1}], "PACK", [{"CPU": 1}]) == "{GPU: 1} more in the cluster"
    assert missing([{"CPU": 1.5}, {"CPU": 1.5}], "PACK", [{"CPU": 1}, {"CPU": 2}]).startswith("enough in all")


def test_autoscaling_and_replica_arguments():
    args = AppArgs(autoscaling_config={"min_replicas": 1, "max_replicas": 3, "initial_replicas": 2})
    assert args.initial_replicas() == 2 and AppArgs().initial_replicas() == 1
    with pytest.raises(pydantic.ValidationError, match="num_replicas or autoscaling_config, not both"):
        AppArgs(num_replicas=2, autoscaling_config={"max_replicas": 2})
    with pytest.raises(pydantic.ValidationError, match="max_replicas"):
        AppArgs(autoscaling_config={"min_replicas": 3, "max_replicas": 2})
    with pytest.raises(pydantic.ValidationError, match="min_replicas must be at least 1"):
        AppArgs(autoscaling_config={"min_replicas": 0, "max_replicas": 2})
    with pytest.raises(pydantic.ValidationError, match="shard_cpus"):
        AppArgs(shard_cpus=0)


def test_the_watch_ends_quietly_when_its_replica_stops(caplog):
    """A stopping replica shuts its thread pool down before the watch task ends: the watch then stops
    instead of logging, every poll, a warning about futures after shutdown; a poll that fails (a GCS
    hiccup) is logged and the watch goes on."""
    import asyncio

    from deployments import placement

    class Hiccup(placement.PlacementWatch):
        def poll(self):
            raise ConnectionError("GCS unreachable")

    async def main():
        watch = Hiccup("app", AppArgs())
        loop = asyncio.get_running_loop()
        going = loop.create_task(watch.run())

        async def logged():   # the failed poll reached the watch, which logged it
            while not caplog.records:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(logged(), 10)
        assert not going.done()
        going.cancel()
        await loop.shutdown_default_executor()
        await asyncio.wait_for(watch.run(), 2)   # returns at once: the executor takes no more work

    with caplog.at_level("WARNING", logger=placement.log.name):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == ["placement watch: ConnectionError: GCS unreachable"]
