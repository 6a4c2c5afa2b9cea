"""A one-shot all-reduce over symmetric memory for small messages (CUDA, NCCL groups): every rank copies
its part into a peer-mapped buffer, waits at a barrier and adds every part itself, in one kernel
(torch.ops.symm_mem.one_shot_all_reduce_out: sums in bf16 and fp32). Buffers are allocated once when the
group starts, so a call allocates nothing and can be captured; other messages go through NCCL.
Multicast (NVLS) stays off (`disable_multicast`, before any process group starts). The kernel waits for
its peers without a timeout; the shard group's command timeout bounds a stuck one. DLLM_SMALL_ALLREDUCE=0
turns the path off, DLLM_SMALL_ALLREDUCE_BYTES sets its largest message (default 2 MiB). Why: docs/kernels.md.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

import torch
import torch.distributed as dist

log = logging.getLogger("dllm.tp")

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ENABLE_ENV, BYTES_ENV = "DLLM_SMALL_ALLREDUCE", "DLLM_SMALL_ALLREDUCE_BYTES"
DEFAULT_MAX_BYTES = 2 << 20
WORLD_SIZES = (2, 4, 8)              # the world sizes the kernel is specialised for (others: NCCL)
DTYPES = (torch.bfloat16, torch.float32)
ALIGN = 16                           # the kernel's widest vector: a 16-byte aligned output is written in place


def disable_multicast(environ=os.environ) -> None:
    """Before the process group starts (NCCL, NVSHMEM and symmetric memory read these when they start)."""
    environ.update(MULTICAST_OFF)


def enabled_by_env(environ=os.environ) -> bool:
    return environ.get(ENABLE_ENV, "1") != "0"


def max_bytes_from_env(environ=os.environ) -> int:
    value = environ.get(BYTES_ENV)
    if value is None:
        return DEFAULT_MAX_BYTES
    if not value.isdigit() or int(value) % ALIGN:
        raise ValueError(f"{BYTES_ENV}={value!r}: a byte count, a multiple of {ALIGN}")
    return int(value)


def symm_mem_missing() -> str | None:
    """Why this torch cannot run the one-shot all-reduce here, or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
        torch.ops.symm_mem.one_shot_all_reduce_out.default
    except (ImportError, AttributeError, RuntimeError) as err:
        return f"torch has no symmetric-memory one-shot all-reduce ({type(err).__name__}: {err})"
    return None


def group_path(device_type: str, backend: str, world_size: int, enabled: bool, missing: str | None) -> str | None:
    """Why a group cannot use the one-shot path (its log line says so), or None when it can."""
    if world_size == 1:
        return "world size 1: no collectives"
    if not enabled:
        return f"turned off ({ENABLE_ENV}=0)"
    if device_type != "cuda" or backend != "nccl":
        return f"{device_type}/{backend}: the plain collectives"
    if world_size not in WORLD_SIZES:
        return f"world size {world_size}: the one-shot kernel takes {WORLD_SIZES}"
    return missing


def takes(nbytes: int, dtype: torch.dtype, op: dist.ReduceOp, max_bytes: int) -> bool:
    """Whether the one-shot path takes one message (its group uses the path): a sum in bf16 or fp32 of
    a byte count in (0, max_bytes], a multiple of 4 (the kernel's smallest vector)."""
    return op == dist.ReduceOp.SUM and dtype in DTYPES and 0 < nbytes <= max_bytes and nbytes % 4 == 0


ReduceOut = Callable[[torch.Tensor, str, str, torch.Tensor], torch.Tensor]


class OneShotAllReduce:
    """all_reduce(x) for the messages `takes` accepts: x copied into this rank's symmetric buffer, the
    one-shot kernel writes the sum into x itself when x is contiguous and 16-byte aligned, else into a
    scratch buffer that is copied back into x. In place, like dist.all_reduce."""

    def __init__(self, buffer: torch.Tensor, scratch: torch.Tensor, group_name: str,
                 reduce_out: ReduceOut | None = None):
        assert buffer.dtype == scratch.dtype == torch.uint8 and buffer.numel() == scratch.numel()
        self.buffer, self.scratch, self.group_name = buffer, scratch, group_name
        self.max_bytes = buffer.numel()
        self.reduce_out = reduce_out or torch.ops.symm_mem.one_shot_all_reduce_out

    @classmethod
    def start(cls, group: dist.ProcessGroup, device: torch.device, max_bytes: int) -> "OneShotAllReduce":
        """Collective: every rank of `group` allocates and maps its buffer."""
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buffer, group)
        return cls(buffer, torch.empty(max_bytes, dtype=torch.uint8, device=device), group.group_name)

    def takes(self, x: torch.Tensor, op: dist.ReduceOp) -> bool:
        return takes(x.numel() * x.element_size(), x.dtype, op, self.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        part = self.buffer[:nbytes].view(x.dtype)
        part.view(x.shape).copy_(x)
        if x.is_contiguous() and x.data_ptr() % ALIGN == 0:
            self.reduce_out(part, "sum", self.group_name, x.view(-1))
            return x
        out = self.scratch[:nbytes].view(x.dtype)
        self.reduce_out(part, "sum", self.group_name, out)
        return x.copy_(out.view(x.shape))


def start_small_allreduce(group: dist.ProcessGroup, rank: int, world_size: int, device: torch.device | str,
                          enabled: bool | None = None, max_bytes: int | None = None) -> OneShotAllReduce | None:
    """The group's one-shot path, or None (NCCL / gloo for everything); logs which. Collective over
    `group` when the path may apply: the ranks agree (a MIN over NCCL) on using it, so a rank whose
    buffer could not be mapped makes every rank use NCCL instead of waiting for it in a kernel."""
    device = torch.device(device)
    enabled = enabled_by_env() if enabled is None else enabled
    backend = dist.get_backend(group) if world_size > 1 else "none"
    why_not = group_path(device.type, backend, world_size, enabled,
                         symm_mem_missing() if device.type == "cuda" else None)
    if why_not is not None:
        if world_size > 1:
            log.info("tp rank %d/%d: all-reduce through %s (%s)", rank, world_size, backend, why_not)
        return None
    max_bytes = max_bytes_from_env() if max_bytes is None else max_bytes
    fast, error = None, None
    try:
        fast = OneShotAllReduce.start(group, device, max_bytes)
    except Exception as err:  # noqa: BLE001 - any failure to map peer memory means: use NCCL
        error = err
    agreed = torch.tensor([0 if fast is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if agreed.item() == 0:
        log.warning("tp rank %d/%d: all-reduce through NCCL (symmetric memory could not be used%s)", rank,
                    world_size, f": {type(error).__name__}: {error}" if error else " on another rank")
        return None
    log.info("tp rank %d/%d: all-reduce one-shot over symmetric memory up to %d bytes (sums in bf16/fp32), "
             "NCCL above; multicast off", rank, world_size, max_bytes)
    return fast
