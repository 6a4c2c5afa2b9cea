"""benchmarks/prefix_lookup_bench.py at a small size: it drives the real scheduler over a pool of cached
pages, counts the shared prefix's hits, and times the lookups within the scheduler's time and the addresses'
hashing as requests come."""
from benchmarks.prefix_lookup_bench import measure
from workers import kv_pages


def test_the_lookup_bench_times_real_lookups_within_the_schedulers_time():
    hashes = kv_pages.page_hashes
    got = measure(cached_pages=300, prompt_len=512, requests=12)
    assert kv_pages.page_hashes is hashes   # the timing wrapper is taken off again
    assert got["cached_pages"] >= 300 and got["requests"] == 12 and got["commands"] >= 2
    # the common system prefix (128 tokens, 8 pages) is a hit for every request but the first admitted
    assert 128 * 11 / 12 <= got["hit_tokens_per_request"] <= 128
    assert 0 < got["lookup_share_of_schedule"] < 1 and got["lookup_us_per_request"] > 0
    # the addresses are hashed as a request comes, within its add, not in a command's schedule
    assert 0 < got["address_us_per_request"] <= got["add_us_per_request"]
