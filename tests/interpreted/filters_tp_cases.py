"""The case and the TP rank body of tests/interpreted/test_interpreted_filters_tp.py: the filters' triton
passes over each rank's vocabulary slice (in triton's interpreter: the spawned ranks inherit
TRITON_INTERPRET=1), at every setting of the kernel's module constants in one spawn of the ranks."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from model.parallel.group import TPGroup, shard_range

# ((SPLIT, COUNT_BLOCK, MASS_BLOCK), V) for TP = 2. The interpreter's time goes by programs (row
# positions x splits) far more than by the entries they read, so each setting takes the vocabulary
# that covers what it is there for at the fewest splits:
# - the kernel's tiling, V = 3000: a rank's 1500 are one split of 3 cached tiles (512, 512, a ragged
#   476), so k = 3 is within a rank's tiles (a finite top-k bound L, tiles skipped) and k = 5, 40 past
#   them (L = -inf);
# - small tiles, V = 2000: a rank's 1000 are 2 splits (512 and a ragged 488), 8 tiles of 128, so the
#   counts and masses are all-reduced over splits and ranks, k = 3 and 5 are within a rank's tiles
#   (L finite, tiles below it skipped) and k = 40 past them
SETTINGS = [((16384, 2048, 512), 3000), ((512, 256, 128), 2000)]


def filter_case(V: int, seed: int = 3) -> dict:
    """Logits and asks for the filters' passes at TP = 2 against TP = 1: rows asking top-k only (k = 5),
    top-p only, both (k = 3 and k = 40) and neither. Position 0 of each row asking a filter has its own
    shape: survivors clustered in rank 0's slice (top-k only), in the last rank's (both), every logit
    below 0 (top-p only: a negative threshold), a run of -inf (k = 40, p = 0.8); position 1 is spread
    over both ranks. fp32 divided by T and bf16 softcapped."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 2, V, generator=gen) * 3
    x[0, 0, V // 3:V // 3 + 10] = 14.0 + torch.randn(10, generator=gen)   # rank 0's slice only
    x[2, 0, V - 40:V - 30] = 14.0 + torch.randn(10, generator=gen)        # the last rank's only
    x[4, 0, :200] = -torch.inf                                            # a whole small tile of -inf
    x[1, 0] = torch.randn(V, generator=gen) * 1.5 - 8.0   # every logit below 0: a negative top-p threshold
    return {"x": x, "temperature": torch.tensor([0.7, 1.0, 1.3, 0.0, 2.0]),
            "top_k": torch.tensor([5, 0, 3, 0, 40]), "top_p": torch.tensor([1.0, 0.6, 0.9, 1.0, 0.8]),
            "kinds": [(torch.float32, None, True), (torch.bfloat16, 30.0, False)]}


def triton_filters_worker(rank: int, world_size: int, out_dir: str) -> None:
    """TP rank body: model/kernels/filters.py's thresholds over this rank's slice at each of SETTINGS,
    with its per-pass count and mass all-reduces over gloo; saved to out_dir/s{n}-rank{r}.pt for the
    parent to compare against TP = 1."""
    import model.kernels.filters as F

    tp = TPGroup(rank=rank, world_size=world_size, group=dist.group.WORLD)
    for n, (constants, V) in enumerate(SETTINGS):
        F.SPLIT, F.COUNT_BLOCK, F.MASS_BLOCK = constants
        c = filter_case(V)
        v0, v1 = shard_range(V, rank, world_size)
        out = []
        for dtype, softcap, on_scaled in c["kinds"]:
            x = c["x"].to(dtype)[..., v0:v1].contiguous()
            out.append(F.triton_threshold(x, c["temperature"], c["top_k"], c["top_p"], v0, tp, softcap=softcap,
                                          on_scaled=on_scaled))
        torch.save(out, Path(out_dir) / f"s{n}-rank{rank}.pt")
