"""The failures that cross the control plane, torch-free so that the coordinator and the ingress can
name them without loading the shards' code."""


class ShardFailure(RuntimeError):
    """A rank failed or stopped answering; the in-flight command is lost."""
