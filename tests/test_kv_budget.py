"""The KV pool's size from a device's memory (model/kv_budget.py): what a sliding group holds at most,
the split between full and sliding groups, and the budget gpu_memory_utilization leaves."""
from model.kv_budget import ahead_positions, memory_budget, pool_pages, sliding_pages
from model.protocol import COMMANDS_AHEAD
from workers.kv_pages import KVPages, PageGroup


def test_a_full_attention_model_takes_the_whole_budget_in_pages():
    # 3 layers' pages of 1 KiB each: 10 KiB -> 9 pages and the sink
    assert pool_pages(10 * 3072 + 100, [3072], [None], sliding_cap=0) == [9]
    assert pool_pages(3072 - 1, [3072], [None], sliding_cap=0) == [0]   # not even the sink: none


def test_sliding_groups_stop_at_their_cap_and_the_full_group_gets_the_rest():
    full, sliding = 1000, 5000            # bytes a page: 1 full layer, 5 sliding layers
    budget = 101 * (full + sliding)       # room for 100 pages of both (and the sinks)
    assert pool_pages(budget, [full, sliding], [None, 512], sliding_cap=500) == [100, 100]
    got = pool_pages(budget, [full, sliding], [None, 512], sliding_cap=40)
    assert got[1] == 40 and got[0] == (budget - 41 * sliding) // full - 1
    assert (got[0] + 1) * full + (got[1] + 1) * sliding <= budget < (got[0] + 2) * full + (got[1] + 1) * sliding


def test_the_sliding_cap_is_what_the_scheduler_reserves_for_one_request():
    """KVPages reserves a sliding group's pages by the same rule the budget caps it by, for the furthest
    a request's tables run ahead (a prefill chunk, the commands in flight, a canvas of scratch)."""
    ahead = ahead_positions(max_model_len=8192, prefill_chunk=2048, max_steps_per_command=8, canvas=256)
    assert ahead == 2048 + -(-COMMANDS_AHEAD * 8 // 2) * 256 + 256
    pages = KVPages([PageGroup(1000), PageGroup(1000, window=512)], 16, b"")
    assert pages.pages_for(8192 + 256, ahead) == [(8192 + 256) // 16, sliding_pages(512, ahead, 16)]
    assert sliding_pages(512, ahead, 16) == 32 + -(-ahead // 16) + 2
    assert ahead_positions(1000, 2048, 8, 32) == 1000 + 8 * 32 + 32   # a prompt is at most max_model_len


def test_the_budget_counts_what_is_in_use_and_the_steps_twice():
    gib = 2**30
    assert memory_budget(total=80 * gib, free=60 * gib, utilization=0.9, steps_peak=2 * gib) == 72 * gib - 20 * gib - 4 * gib
    assert memory_budget(total=80 * gib, free=10 * gib, utilization=0.5, steps_peak=0) < 0   # another process's
