"""A layer's independent branch on a second CUDA stream, beside the rest of the layer (DiffusionGemma's
dense MLP beside its routing and experts; docs/kernels.md says why, and why no record_stream is needed).

    branch = side_branch(x)
    with branch:
        shared = mlp(x)          # queued on the side stream, after everything queued before the fork
    routed = experts(...)        # queued on the current stream meanwhile
    branch.join()                # the current stream waits for the branch: `shared` is ready after this

In a CUDA graph the fork and the join are edges, so a replay keeps the overlap. Off CUDA it runs inline.
"""
from __future__ import annotations

import torch

_streams: dict[torch.device, torch.cuda.Stream] = {}


class SideBranch:
    def __init__(self, stream: torch.cuda.Stream | None):
        self.stream = stream
        self._context = None

    def __enter__(self) -> SideBranch:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            self._context = torch.cuda.stream(self.stream)
            self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)
            self._context = None

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


def side_branch(x: torch.Tensor) -> SideBranch:
    """A branch for work on x's device: its side stream on CUDA (one per device, created on first use,
    at high priority so the branch's few blocks start as soon as SMs free up), inline elsewhere."""
    if not x.is_cuda:
        return SideBranch(None)
    stream = _streams.get(x.device)
    if stream is None:
        stream = _streams[x.device] = torch.cuda.Stream(x.device, priority=-1)
    return SideBranch(stream)
