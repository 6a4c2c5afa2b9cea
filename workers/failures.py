"""What a shard group raises when a rank fails, torch-free: the coordinator catches it without importing
the shard groups' code (workers/shard_group.py, workers/ray_shards.py: torch and the runner)."""


class ShardFailure(RuntimeError):
    """A rank failed or stopped answering; the in-flight command is lost."""
