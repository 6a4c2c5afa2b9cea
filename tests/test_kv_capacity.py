"""benchmarks/kv_capacity.py: the same KV memory as 8 slots of max_model_len, split into pages, admits
as many 1k-prompt requests as whole pages allow (the full-size Nemotron-LD's layout, counted as fake
tensors)."""
from benchmarks.kv_capacity import fits


def test_the_paged_pool_admits_what_its_pages_hold():
    got = fits("nemotron-ld", max_model_len=2048, prompt_len=1024, max_tokens=128)
    key = "kv_capacity.nemotron-ld.2048"
    assert got[f"{key}.full_pages"] == 8 * (2048 + 32) // 16            # the slots' memory, to the page
    need = -(-(1024 + 128 + 32) // 16)                                    # prompt, 4 canvases, a canvas of scratch
    assert got[f"{key}.paged"] == got[f"{key}.full_pages"] // need and got[f"{key}.slots"] == 8
