"""What every triton kernel here asks of where it runs (no triton import: model.attention reads it on
CPU-only paths too)."""
from __future__ import annotations

import functools
import os

import torch

# triton's CPU interpreter (the CPU tests; chosen when triton is imported, so fixed per process): it
# multiplies 16-bit floats as raw bits (the kernels hand it fp32) and has no libdevice
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def sm_count(device: torch.device) -> int:
    """The GPU's streaming multiprocessors; under the interpreter an H200's (132), so the CPU tests run
    the GPU's split counts."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132
