"""What the Ray cluster has, and whether it can hold a model replica: decisions about hardware come from
the cluster, not from the node that happens to build the application (`serve deploy` builds it in a Ray
task on any node, usually a CPU-only head).

`ClusterResources.read()` is the nodes alive now (their total resources, not what is free: the check
is whether the cluster can ever hold a replica) plus the node types an autoscaler reports it may add.
`resolve_device` turns `device: auto` into cuda when the cluster has GPUs. `unplaceable` says why
placement groups of the given bundles can never be placed on those nodes (an exact search over
bundles and nodes, with Ray's strategies), or None when they can. Torch-free: the ingress uses it too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import ray

log = logging.getLogger("dllm.cluster")

EPS = 1e-9            # resource amounts are floats (a shard may ask 0.5 CPU)
SEARCH_STEPS = 200_000  # a search this long is undecided: the deploy goes on (the placement timeout bounds it)


@dataclass(frozen=True)
class ClusterResources:
    nodes: tuple[dict, ...]                    # per alive node: its resources (CPU, GPU, custom ones)
    launchable: tuple[tuple[dict, int], ...] = ()   # node types an autoscaler may add: (resources, max count)
    where: str = "the Ray cluster"

    @classmethod
    def read(cls) -> "ClusterResources":
        """The cluster this process is connected to (`ray.init` must have run)."""
        nodes = tuple({k: float(v) for k, v in n["Resources"].items() if counts(k)}
                      for n in ray.nodes() if n.get("Alive"))
        return cls(nodes, _launchable(), f"the Ray cluster at {ray.get_runtime_context().gcs_address}")

    @classmethod
    def this_machine(cls) -> "ClusterResources":
        """This machine's GPUs, as a `ray.init()` here would declare them (no Ray connection: `serve run
        module:build_app` builds before it connects, and the Ray it then starts is this machine's)."""
        from ray._private.accelerators import get_accelerator_manager_for_resource

        gpus = get_accelerator_manager_for_resource("GPU").get_current_node_num_accelerators()
        return cls(({"GPU": float(gpus)},) if gpus else ({},), (), "this machine (not connected to Ray)")

    def gpus(self) -> float:
        return sum(n.get("GPU", 0.0) for n in self.nodes) + sum(r.get("GPU", 0.0) * c for r, c in self.launchable)

    def describe(self) -> str:
        nodes = "; ".join(fmt_resources(n) for n in self.nodes) or "none"
        more = "".join(f"; up to {c} more of {fmt_resources(r)} (autoscaler)" for r, c in self.launchable)
        return f"{self.where} has {len(self.nodes)} node(s): {nodes}{more}"


def counts(key: str) -> bool:
    """Resources a bundle can ask for (not `memory`, object store, or the implicit per-node ones)."""
    return key not in ("memory", "object_store_memory") and not key.startswith("node:")


def _launchable() -> tuple[tuple[dict, int], ...]:
    """Node types from the cluster config an autoscaler reports to the GCS (autoscaler v2, KubeRay);
    none when it reports none (then only the nodes alive now count)."""
    try:
        config = ray._private.state.state.get_cluster_config()
    except Exception as err:  # noqa: BLE001 - a private API; without it the nodes alive now are what we know
        log.info("no cluster config from the GCS (%s): checking the nodes alive now", err)
        return ()
    if config is None:
        return ()
    return tuple(({k: float(v) for k, v in g.resources.items() if counts(k)}, g.max_count)
                 for g in config.node_group_configs if g.max_count != 0)


def fmt_resources(resources: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items()) if v) + "}"


def resolve_device(device: str, cluster: ClusterResources) -> str:
    """`auto`: cuda if the cluster has (or may add) GPUs, else cpu; `cuda` without a GPU is an error."""
    if device == "auto":
        return "cuda" if cluster.gpus() > 0 else "cpu"
    if device == "cuda" and cluster.gpus() == 0:
        raise ValueError(f"device=cuda, but {cluster.describe()}: no GPU. Use device=cpu (or auto), or add GPU "
                         "nodes")
    return device


def unplaceable(bundles: list[dict], strategy: str, replicas: int, cluster: ClusterResources) -> str | None:
    """Why `replicas` placement groups of `bundles` can never be placed on the cluster's nodes (alive, or
    the most an autoscaler may add), or None if they can."""
    nodes = list(cluster.nodes)
    for resources, count in cluster.launchable:
        nodes += [resources] * (min(count, replicas * len(bundles)) if count > 0 else replicas * len(bundles))
    if fits([bundles] * replicas, strategy, nodes):
        return None
    need = fmt_resources(sum_resources(bundles))
    how = {"STRICT_PACK": f"all on one node ({need} on one node)",
           "STRICT_SPREAD": "each bundle on a different node"}.get(strategy, f"anywhere ({need} in all)")
    times = f" {replicas} times (the replicas Serve starts with)" if replicas > 1 else ""
    return f"{strategy} placement of {bundles}{times}: {how}, and {cluster.describe()}"


def sum_resources(bundles: list[dict]) -> dict:
    total: dict = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = total.get(k, 0.0) + v
    return total


def fits(groups: list[list[dict]], strategy: str, nodes: list[dict]) -> bool:
    """Whether every group's bundles can be placed at once on `nodes` (capacities) under Ray's strategy for
    each group: STRICT_PACK (one node per group), STRICT_SPREAD (distinct nodes within a group), PACK and
    SPREAD (any nodes; they differ only in preference). Depth-first, largest bundles first, trying one
    node of each distinct free capacity per step; an undecided search (over SEARCH_STEPS) answers True."""
    items = sorted(((g, b) for g, group in enumerate(groups) for b in group), key=lambda gb: -sum(gb[1].values()))
    free = [dict(n) for n in nodes]
    used: list[set[int]] = [set() for _ in nodes]   # per node: the groups with a bundle on it
    home: dict[int, int] = {}                       # STRICT_PACK: group -> its node
    steps = [0]

    def place(i: int) -> bool:
        if i == len(items):
            return True
        steps[0] += 1
        if steps[0] > SEARCH_STEPS:
            raise TimeoutError
        group, bundle = items[i]
        candidates = [home[group]] if strategy == "STRICT_PACK" and group in home else range(len(free))
        tried = set()
        for n in candidates:
            if strategy == "STRICT_SPREAD" and group in used[n]:
                continue
            if any(free[n].get(k, 0.0) + EPS < v for k, v in bundle.items()):
                continue
            shape = (tuple(sorted(free[n].items())), frozenset(used[n]))
            if shape in tried:   # a node just like one tried already fails the same way
                continue
            tried.add(shape)
            for k, v in bundle.items():
                free[n][k] -= v
            first = group not in used[n]
            used[n].add(group)
            new_home = strategy == "STRICT_PACK" and group not in home
            if new_home:
                home[group] = n
            if place(i + 1):
                return True
            for k, v in bundle.items():
                free[n][k] += v
            if first:
                used[n].discard(group)
            if new_home:
                del home[group]
        return False

    try:
        return place(0)
    except TimeoutError:
        return True
