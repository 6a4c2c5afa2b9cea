"""Our triton kernels compiled for an H200 on a machine without a GPU.

triton's own compiler and its bundled ptxas build a kernel for sm_90 from the same calls the served
path makes; only the launch is missing. `install()` makes triton's active driver one that targets an
H200, checks each compiled kernel against the H200's limits as triton's CUDA driver does when it loads
one (shared memory, threads), reads its registers and spills from the cubin (cuobjdump) and its
matrix instructions from the PTX, and launches nothing: the outputs of a launch stay as they were
allocated, so callers pass tensors whose values do not matter.

What it catches before a GPU session: kernels the interpreter runs but the compiler rejects, tiles that
need more shared memory than an SM has, register spills, a matmul that lost Hopper's tensor-core
instructions (FP8 operands upcast, tiles too small for a warpgroup). What it cannot: anything about
values or speed, and torch.compile's kernels (inductor needs the device itself).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver

H200 = GPUTarget("cuda", 90, 32)
# what one block of an H200 may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin, 227 KiB): triton's
# CUDA driver refuses to load a kernel that asks for more
MAX_SHARED = 232448
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


@dataclass
class Compiled:
    """One specialization of a kernel as compiled for the H200."""
    kernel: str
    shared: int        # bytes of shared memory a block asks for
    warps: int
    stages: int
    registers: int     # per thread, as ptxas allocated them
    spilled: int       # bytes of local memory per thread: spills (0 in a kernel that fits its registers)
    operands: str      # the type of its first pointer argument ("*bf16", "*fp8e4nv", ...)
    mma: tuple[str, ...]   # its matrix instructions by kind and A operand: "wgmma.e4m3" (Hopper's
                           # warpgroup MMA on FP8), "wgmma.bf16", "mma.bf16" (the per-warp MMA of
                           # earlier GPUs); () for none
    async_copies: bool = False   # loads global -> shared asynchronously (cp.async): how triton pipelines
                                 # a loop's loads over num_stages buffers


def resources(cubin: bytes, name: str) -> tuple[int, int]:
    """(registers, local bytes) a thread of function `name` in a cubin, as cuobjdump reads them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    m = re.search(rf"Function {re.escape(name)}:\s*\n\s*REG:(\d+) .*?LOCAL:(\d+)", out)
    assert m, f"no resource line for {name} in cuobjdump's output:\n{out[:3000]}"
    return int(m.group(1)), int(m.group(2))


def matrix_instructions(ptx: str) -> tuple[str, ...]:
    """The kinds of MMA a kernel's PTX issues, e.g. wgmma.mma_async...f32.e4m3.e4m3 -> "wgmma.e4m3"."""
    found = re.findall(r"\b(wgmma\.mma_async\.sync|mma\.sync)\.aligned\.[\w.]*?\.f32\.(\w+)\.", ptx)
    return tuple(sorted({f"{'wgmma' if op.startswith('wgmma') else 'mma'}.{a}" for op, a in found}))


class _Utils:
    def __init__(self, compiled: list[Compiled]):
        self.compiled = compiled
        # (warps, stages, operands), the MMAs and async copies of the kernel being loaded: triton makes
        # its launcher and calls its load hook first
        self.launch_config, self.mma, self.async_copies = (0, 0, ""), (), False

    def read_ptx(self, module, function, name, metadata_group: dict, hash) -> None:
        """triton's kernel_load_start_hook: the kernel's PTX lies in its cache group."""
        ptx = Path(metadata_group[f"{name}.ptx"]).read_text()
        self.mma, self.async_copies = matrix_instructions(ptx), "cp.async" in ptx

    def get_device_properties(self, device) -> dict:
        return {"max_shared_mem": MAX_SHARED}   # all that triton's loader reads of them

    def load_binary(self, name: str, cubin: bytes, shared: int, device) -> tuple:
        """What cuModuleLoadData and cuFuncGetAttribute would say: the most threads a block of this
        function can have with its registers (65536 per SM, allocated 256 a warp)."""
        registers, spilled = resources(cubin, name)
        per_warp = -(-registers * 32 // 256) * 256
        max_threads = min(1024, 65536 // per_warp * 32)
        warps, stages, operands = self.launch_config
        self.compiled.append(Compiled(name, shared, warps, stages, registers, spilled, operands, self.mma,
                                      self.async_copies))
        return name, name, registers, spilled, max_threads


class H200CompileOnly(DriverBase):
    """triton's driver interface for an H200 that compiles, checks and never launches (module docstring)."""

    def __init__(self):
        self.compiled: list[Compiled] = []
        self.launches = 0
        self.utils = _Utils(self.compiled)

    @classmethod
    def is_active(cls) -> bool:
        return False   # never chosen by triton itself: only by install()

    def get_current_target(self) -> GPUTarget:
        return H200

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        assert device == 0, device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("a compile-only driver builds no launcher")

    def get_benchmarker(self):
        raise NotImplementedError("a compile-only driver times nothing")

    def launcher_cls(self, src, metadata):
        operands = next((t for t in src.signature.values() if t.startswith("*")), "")
        self.utils.launch_config = (metadata.num_warps, metadata.num_stages, operands)

        def launch(*args) -> None:
            self.launches += 1
        return launch


def install() -> H200CompileOnly:
    """Makes every later triton launch in this process compile for the H200 and launch nothing. For a
    process of its own: kernels already compiled for another target keep their caches."""
    assert os.environ.get("TRITON_INTERPRET") != "1", "the interpreter runs kernels; this compiles them"
    compile_only = H200CompileOnly()
    driver.set_active(compile_only)
    knobs.runtime.kernel_load_start_hook.add(compile_only.utils.read_ptx)
    return compile_only
