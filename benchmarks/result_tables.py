"""The tables the docs render from benchmarks/results/ (`python -m benchmarks.results render`), by the name
their markers give. A row names its figures (benchmarks/results.py takes them from the newest file that
holds them all, on the row's card where it names one); a figure no file holds renders as "not measured"."""
from __future__ import annotations

from benchmarks.results import Row, Table

NL, DG = "nemotron-ld-8b", "diffusion-gemma-26b-a4b"
DG8 = DG + "-fp8"
CARDS = ("H100", "H200")
TOK = ",.0f"     # tok/s
COUNT = ",.0f"


def per_card(label: str, keys: tuple[str, ...], fmt: str = ".4g", target: str = "",
             cards: tuple[str, ...] = CARDS) -> tuple[Row, ...]:
    """The row once per card: figures of different cards are not comparable, so each names its own."""
    return tuple(Row(label, keys, fmt, target, card) for card in cards)


def seed(model: str, levels: tuple[int, ...]) -> tuple[str, ...]:
    return tuple(f"traffic.{model}.seed_tok_s.c{c}" for c in levels)


TABLES: dict[str, Table] = {
    # README.md: the headline figures, each the latest of its kind
    "latest": Table("latest", (
        *per_card("FP8 DiffusionGemma 26B-A4B, seed workload served: tok/s at concurrency 1 / 4", seed(DG8, (1, 4)),
                  TOK),
        *per_card("FP8 DiffusionGemma 26B-A4B, one step of 1 / 4 canvases (ms)",
                  (f"fp8.{DG}.step_ms.c1", f"fp8.{DG}.step_ms.c4")),
        Row("FP8 Nemotron-LD 8B, one step of batch 1 / 16 (ms)", (f"fp8.{NL}.step_ms.b1", f"fp8.{NL}.step_ms.b16"),
            card="H100"),
        *per_card("DiffusionGemma 26B-A4B, mixed / homogeneous committed tok/s at concurrency 8",
                  (f"traffic.{DG}.mixed_over_homogeneous",)),
        Row("Nemotron-LD 8B, mixed / homogeneous committed tok/s at concurrency 8",
            (f"traffic.{NL}.mixed_over_homogeneous",), card="H100"),
        Row("Nemotron-LD 8B, seed workload served: tok/s at concurrency 1 / 8", seed(NL, (1, 8)), TOK, card="H100"),
        Row("Nemotron-LD 8B, 8 chats of 5 turns on a 4k-token system prompt: committed tok/s, prefix caching "
            "on / off", ("conversations_committed_tok_s_cached_over_uncached",), ".3g", card="H100"),
        Row("Nemotron-LD 8B, served / bare denoising-step rate", (f"served.{NL}.P2",)),
        Row("DiffusionGemma 26B-A4B, bare runner / transformers' generate, 256 / 768 new tokens",
            (f"bf16.{DG}.over_transformers.n256", f"bf16.{DG}.over_transformers.n768"), ".3g"),
    )),
    # docs/performance.md: the roofline benchmark's BF16 rows (make bench)
    "roofline": Table("BF16, dummy weights, one GPU", (
        Row("Nemotron-LD 8B, batch 1, canvas 32: step / weight-read floor (ms)",
            (f"bf16.{NL}.step_ms.b1", f"bf16.{NL}.floor_ms")),
        Row("  P1: their ratio", (f"bf16.{NL}.P1",), target="<= 1.11"),
        Row("DiffusionGemma 26B-A4B, 1 canvas: step / floor (ms)", (f"bf16.{DG}.step_ms.c1", f"bf16.{DG}.floor_ms")),
        Row("  P1: their ratio", (f"bf16.{DG}.P1",), target="<= 1.11"),
        Row("P2: served (HTTP, coordinator, shard) / bare denoising-step rate, 8B", (f"served.{NL}.P2",),
            target=">= 0.95"),
        Row("P3: bare runner / transformers' generate, 26B-A4B, 256 / 768 new tokens",
            (f"bf16.{DG}.over_transformers.n256", f"bf16.{DG}.over_transformers.n768"), target=">= 8"),
        Row("P4: committed tok/s at 16 concurrent / at 1, 8B", (f"bf16.{NL}.P4",), target=">= 8"),
        Row("SC: DiffusionGemma step with self-conditioning / without", (f"bf16.{DG}.SC",), target="<= 1.03"),
        Row("batch-invariant / default step: 8B batch 1 / 16",
            (f"batch_invariant.{NL}.over_default.b1", f"batch_invariant.{NL}.over_default.b16"), target="cost"),
        Row("batch-invariant / default step: 26B-A4B, 1 canvas", (f"batch_invariant.{DG}.over_default.c1",),
            target="cost"),
        Row("P5: TP = 1 / TP = 2 step, 8B batch 1 / 16", (f"tp.{NL}.tp1_over_tp2.b1", f"tp.{NL}.tp1_over_tp2.b16"),
            target=">= 1.7"),
        Row("P5: TP = 1 / TP = 2 step, 26B-A4B 1 / 4 canvases",
            (f"tp.{DG}.tp1_over_tp2.c1", f"tp.{DG}.tp1_over_tp2.c4"), target=">= 1.7"),
    )),
    # docs/performance.md: the FP8-dynamic shapes, bare runner (make bench's FP8 section)
    "fp8": Table("FP8-dynamic, dummy weights, one GPU", (
        *per_card("copy bandwidth measured in the run (TB/s)", ("copy_bandwidth_tb_s",)),
        *per_card("DiffusionGemma 26B-A4B: step of 1 / 4 canvases (ms)",
                  (f"fp8.{DG}.step_ms.c1", f"fp8.{DG}.step_ms.c4")),
        *per_card("  FP8 / BF16 step, 1 / 4 canvases", (f"fp8.{DG}.over_bf16.c1", f"fp8.{DG}.over_bf16.c4"),
                  target="report"),
        *per_card("  P1: step / FP8 weight-read floor", (f"fp8.{DG}.P1",), target="<= 1.25"),
        *per_card("  the experts' grouped kernel / their weight read (ms)",
                  (f"fp8.{DG}.profile_ms.experts", f"fp8.{DG}.experts_read_ms")),
        Row("Nemotron-LD 8B: step of batch 1 / 16 (ms)", (f"fp8.{NL}.step_ms.b1", f"fp8.{NL}.step_ms.b16"),
            card="H100"),
        Row("  FP8 / BF16 step, batch 1 / 16", (f"fp8.{NL}.over_bf16.b1", f"fp8.{NL}.over_bf16.b16"),
            target="report", card="H100"),
        Row("  P1: step / FP8 weight-read floor", (f"fp8.{NL}.P1",), target="<= 1.25", card="H100"),
    )),
    # docs/performance.md: where an FP8 step's time goes at batch 1 (torch.profiler, eager, kernels only)
    "fp8-profile": Table("DiffusionGemma 26B-A4B, ms a step", per_card(
        "", tuple(f"fp8.{DG}.profile_ms.{k}" for k in ("experts", "dense_fp8", "attention", "attention_split_combine",
                                                         "lm_head", "self_conditioning", "vocabulary_pass",
                                                         "row_kernel"))),
        columns=("experts", "dense FP8 GEMMs", "attention", "its split combine", "LM head", "P W",
                 "vocabulary pass", "row kernel")),
    "fp8-profile-8b": Table("Nemotron-LD 8B, ms a step", (
        Row("", tuple(f"fp8.{NL}.profile_ms.{k}" for k in ("dense_fp8", "dense_fp8_split_k", "row_kernel", "lm_head",
                                                           "attention")), card="H100"),),
        columns=("cuBLAS FP8 GEMMs", "split-K down projections", "row kernel", "LM head", "attention")),
    # docs/performance.md: benchmarks/step_bound.py, arithmetic on the shapes
    "step-bound": Table("the least a step can take", (
        Row("DiffusionGemma BF16: step >= (ms) at 1 / 2 / 4 / 8 canvases",
            tuple(f"step_bound.{DG}.bf16.step_ms.c{c}" for c in (1, 2, 4, 8))),
        Row("  its best gain over 1 canvas", tuple(f"step_bound.{DG}.bf16.gain.c{c}" for c in (2, 4, 8)), ".3g"),
        Row("DiffusionGemma FP8: step >= (ms) at 1 / 2 / 4 / 8 canvases",
            tuple(f"step_bound.{DG}.fp8.step_ms.c{c}" for c in (1, 2, 4, 8))),
        Row("  its best gain over 1 canvas", tuple(f"step_bound.{DG}.fp8.gain.c{c}" for c in (2, 4, 8)), ".3g"),
        Row("Nemotron-LD 8B BF16: step >= (ms) at 1 / 4 / 8 / 16 rows",
            tuple(f"step_bound.{NL}.bf16.step_ms.b{b}" for b in (1, 4, 8, 16))),
        Row("  its best gain over 1 row", tuple(f"step_bound.{NL}.bf16.gain.b{b}" for b in (4, 8, 16)), ".3g"),
        Row("measured: DiffusionGemma BF16 / FP8 step at 1 canvas (ms)",
            (f"fp8.{DG}.bf16_step_ms.c1", f"fp8.{DG}.step_ms.c1"), card="H200"),
        Row("measured: the same at 4 canvases (ms)", (f"fp8.{DG}.bf16_step_ms.c4", f"fp8.{DG}.step_ms.c4"),
            card="H200"),
    )),
    # docs/performance.md: the closed graph set as the traffic benchmark's /metrics saw it after warm-up
    "graphs": Table("graphs captured before ready (max_num_seqs 8, max_model_len 2048)", (
        Row("Nemotron-LD 8B: graphs / their MiB", (f"traffic.{NL}.cuda_graphs", f"traffic.{NL}.cuda_graph_memory_mib"),
            COUNT, card="H100"),
        Row("DiffusionGemma 26B-A4B BF16: graphs / their MiB",
            (f"traffic.{DG}.cuda_graphs", f"traffic.{DG}.cuda_graph_memory_mib"), COUNT),
        Row("DiffusionGemma 26B-A4B FP8: graphs / their MiB",
            (f"traffic.{DG8}.cuda_graphs", f"traffic.{DG8}.cuda_graph_memory_mib"), COUNT),
    )),
    # docs/performance.md: benchmarks/traffic.py, one cold start of a full-size shape, concurrency 8
    "traffic": Table("served, from one cold start", (
        Row("Nemotron-LD 8B: mixed / homogeneous committed tok/s", (f"traffic.{NL}.mixed_over_homogeneous",),
            target=">= 0.9", card="H100"),
        Row("  mixed / matched (the options' own cost), matched / homogeneous (the modes')",
            (f"traffic.{NL}.mixed_over_matched", f"traffic.{NL}.matched_over_homogeneous"), card="H100"),
        Row("  p99 / median request latency under the mix", (f"traffic.{NL}.mixed_p99_over_median",),
            target="<= 2", card="H100"),
        Row("  graphs captured after ready; GPU MiB after the mix - after warm-up",
            (f"traffic.{NL}.graph_captures_after_ready", f"traffic.{NL}.gpu_memory_mixed_minus_warmup_mib"),
            COUNT, target="0; about 0", card="H100"),
        Row("  seed workload tok/s at concurrency 1 / 2 / 4 / 8", seed(NL, (1, 2, 4, 8)), TOK, card="H100"),
        Row("  with a JSON schema / without at 1; unconstrained tok/s beside constrained / unconstrained ones",
            (f"traffic.{NL}.seed_schema_over_plain_c1", f"traffic.{NL}.schema_neighbours_ratio"), ".3g",
            target="; >= 0.95", card="H100"),
        Row("  seconds from start to /health 200 (cold caches)", (f"traffic.{NL}.cold_start_health_200_s",),
            COUNT, card="H100"),
        *per_card("DiffusionGemma 26B-A4B: mixed / homogeneous committed tok/s",
                  (f"traffic.{DG}.mixed_over_homogeneous",),
                  target=">= 0.9"),
        *per_card("  ms a pass, homogeneous / mixed",
                  (f"traffic.{DG}.ms_per_pass.homogeneous", f"traffic.{DG}.ms_per_pass.mixed")),
        *per_card("  p99 / median request latency under the mix", (f"traffic.{DG}.mixed_p99_over_median",),
                  target="<= 2"),
        *per_card("  graphs captured after ready; GPU MiB after the mix - after warm-up",
                  (f"traffic.{DG}.graph_captures_after_ready", f"traffic.{DG}.gpu_memory_mixed_minus_warmup_mib"),
                  COUNT, target="0; about 0"),
        Row("  seed workload tok/s at concurrency 1 / 2 / 4 / 8", seed(DG, (1, 2, 4, 8)), TOK, card="H100"),
        *per_card("  with a JSON schema / without at 1; unconstrained tok/s beside constrained / unconstrained ones",
                  (f"traffic.{DG}.seed_schema_over_plain_c1", f"traffic.{DG}.schema_neighbours_ratio"), ".3g",
                  target="; >= 0.95"),
        *per_card("  seconds from start to /health 200 (cold caches)", (f"traffic.{DG}.cold_start_health_200_s",),
                  COUNT),
        *per_card("DiffusionGemma 26B-A4B FP8: seed workload tok/s at concurrency 1 / 4", seed(DG8, (1, 4)), TOK,
                  target=">= 1,600 at 1"),
        *per_card("  shards' busy share of the seed workload at 1 / 4",
                  (f"traffic.{DG8}.seed_busy_share.c1", f"traffic.{DG8}.seed_busy_share.c4"), ".3g"),
        *per_card("  mixed / homogeneous committed tok/s", (f"traffic.{DG8}.mixed_over_homogeneous",),
                  target=">= 0.9"),
        *per_card("  seconds from start to /health 200 (cold caches)", (f"traffic.{DG8}.cold_start_health_200_s",),
                  COUNT),
    )),
    # docs/performance.md: benchmarks/attention_bench.py's libraries_us, one 256-query canvas row, 16 heads
    "attention-libraries": Table("DiffusionGemma attention, one canvas row (us a call)", (
        Row("sliding layer (head dim 256, 8 kv heads, 1,279 keys): ours / FlashAttention-2 / cuDNN / "
            "flex_attention / memory-efficient",
            tuple(f"attention.{DG}.sliding_1279_keys.{k}_us" for k in ("served", "flash", "cudnn", "flex",
                                                                        "efficient"))),
        Row("full layer (head dim 512, 2 kv heads), 1,536 keys: ours / memory-efficient (the only library "
            "kernel that runs)",
            (f"attention.{DG}.full_1536_keys.served_us", f"attention.{DG}.full_1536_keys.efficient_us")),
        Row("the same at 2,304 keys", (f"attention.{DG}.full_2304_keys.served_us",
                                        f"attention.{DG}.full_2304_keys.efficient_us")),
    )),
    # docs/benchmarking.md: serve_bench's sweep of the tiny model on a CPU
    "serve-bench-cpu": Table("concurrency", tuple(
        Row(str(c), tuple(f"serve_bench.tiny-nemotron-ld.c{c}.{k}" for k in (
            "request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms",
            "committed_per_step"))) for c in (1, 2, 4, 8)),
        columns=("req/s", "output tok/s", "TTFT mean (ms)", "TTFT p99 (ms)", "ITL mean (ms)", "ITL p99 (ms)",
                 "tokens a step")),
    # docs/benchmarking.md: benchmarks/cache_bench.py, each setting on its own cold server
    "cache-bench": Table("the tiny model on a CPU", (
        Row("one chat alone: TTFT of turns 2.. on / off, mean and p50", (
            "conversations_alone_ttft_mean_cached_over_uncached", "conversations_alone_ttft_p50_cached_over_uncached"),
            ".3g", "report", "CPU"),
        Row("conversations: TTFT of turns 2.., mean with prefix caching on / off (s)",
            ("conversations_ttft_mean_s_cached", "conversations_ttft_mean_s_uncached"), ".3g", card="CPU"),
        Row("  p50 on / off; p99 on / off (s)",
            ("conversations_ttft_p50_s_cached", "conversations_ttft_p50_s_uncached",
             "conversations_ttft_p99_s_cached", "conversations_ttft_p99_s_uncached"), ".3g", card="CPU"),
        Row("  TTFT on / off: mean, p50", ("conversations_ttft_mean_cached_over_uncached",
                                          "conversations_ttft_p50_cached_over_uncached"), ".3g", "report", "CPU"),
        Row("  hit rate (cached / prompt tokens) on / off; turns 2.. alone, on",
            ("conversations_hit_rate_cached", "conversations_hit_rate_uncached",
             "conversations_hit_rate_later_turns_cached"), ".3g", card="CPU"),
        Row("  wall time on / off (s)", ("conversations_wall_s_cached", "conversations_wall_s_uncached"), ".3g",
            card="CPU"),
        Row("long prompt: running requests' ITL p99 without / with it, chunked prefill (s)",
            ("long_prompt_itl_p99_s_chunked_without_long", "long_prompt_itl_p99_s_chunked_with_long"), ".3g",
            card="CPU"),
        Row("  with / without", ("long_prompt_itl_p99_ratio_chunked",), ".3g", "<= 2", "CPU"),
        Row("  unchunked: without / with (s)",
            ("long_prompt_itl_p99_s_unchunked_without_long", "long_prompt_itl_p99_s_unchunked_with_long"), ".3g",
            card="CPU"),
        Row("  with / without", ("long_prompt_itl_p99_ratio_unchunked",), ".3g", "report", "CPU"),
        Row("  running requests' TTFT max without / with it, chunked (s)",
            ("long_prompt_running_ttft_max_s_chunked_without_long", "long_prompt_running_ttft_max_s_chunked_with_long"),
            ".3g", card="CPU"),
        Row("  the long prompt's TTFT chunked / unchunked (s)",
            ("long_prompt_ttft_s_chunked", "long_prompt_ttft_s_unchunked"), ".3g", card="CPU"),
    )),
    # docs/benchmarking.md: benchmarks/cache_bench.py on a GPU, the 8B's full-size shapes, every request in AR mode
    "cache-bench-gpu": Table("Nemotron-LD 8B shapes, AR mode, 8 chats x 5 turns, 4k-token system prompt", (
        Row("one chat alone first: TTFT of turns 2.., mean / p50 with prefix caching on (s)",
            ("conversations_alone_ttft_mean_s_cached", "conversations_alone_ttft_p50_s_cached"), ".3g", card="H100"),
        Row("  off (s)", ("conversations_alone_ttft_mean_s_uncached", "conversations_alone_ttft_p50_s_uncached"),
            ".3g", card="H100"),
        Row("  TTFT on / off: mean / p50", ("conversations_alone_ttft_mean_cached_over_uncached",
                                           "conversations_alone_ttft_p50_cached_over_uncached"), ".3g", "<= 0.2",
            "H100"),
        Row("  of a turn's TTFT (every turn, mean), the path through HTTP, the ingress and Ray, on / off (s)",
            ("conversations_alone_path_s_cached", "conversations_alone_path_s_uncached"), ".3g", card="H100"),
        Row("conversations: TTFT of turns 2.., mean / p50 / p99 with prefix caching on (s)",
            ("conversations_ttft_mean_s_cached", "conversations_ttft_p50_s_cached", "conversations_ttft_p99_s_cached"),
            ".3g", card="H100"),
        Row("  off (s)", ("conversations_ttft_mean_s_uncached", "conversations_ttft_p50_s_uncached",
                          "conversations_ttft_p99_s_uncached"), ".3g", card="H100"),
        Row("  TTFT on / off: mean / p50 / p99",
                  ("conversations_ttft_mean_cached_over_uncached", "conversations_ttft_p50_cached_over_uncached",
                   "conversations_ttft_p99_cached_over_uncached"), ".3g", "<= 0.2", "H100"),
        Row("  hit rate (cached / prompt tokens) on; turns 2.. alone", ("conversations_hit_rate_cached",
                                                                        "conversations_hit_rate_later_turns_cached"),
            ".3g", card="H100"),
        Row("  committed tok/s on / off", ("conversations_committed_tok_s_cached", "conversations_committed_tok_s_uncached"),
            ".3g", card="H100"),
        Row("  committed tok/s on / off, their ratio", ("conversations_committed_tok_s_cached_over_uncached",),
            ".3g", ">= 1.5", "H100"),
        Row("  kernels compiled while serving, on / off", ("conversations_kernel_compiles_cached",
                                                            "conversations_kernel_compiles_uncached"), ".3g", "0",
            "H100"),
        Row("long prompt (16k tokens): running requests' ITL p99 with it / without, chunked prefill",
            ("long_prompt_itl_p99_ratio_chunked",), ".3g", "<= 2", "H100"),
    )),
    # docs/benchmarking.md: benchmarks/ttft_breakdown.py, cache_bench's lone chat on the engine alone
    "ttft-breakdown": Table("Nemotron-LD 8B shapes, AR, a 4k-token prefix, ms (median)", (
        *(Row(f"{case}: first token / its commands / their prefills / their steps",
              tuple(f"ttft.{case}.{part}_ms" for part in ("ttft", "command", "prefill", "steps")), ".3g", card="H100")
          for case in ("cold", "cached", "short")),
        Row("cached: the scheduler's schedule / apply", ("ttft.cached.schedule_ms", "ttft.cached.apply_ms"), ".3g",
            card="H100"),
        Row("first token cached / cold, in one process", ("ttft.cached_over_cold",), ".3g", "<= 0.2", "H100"),
    )),
    # docs/benchmarking.md: benchmarks/kv_capacity.py, the scheduler's admission over each full-size layout
    "kv-capacity": Table("1k-token prompts, 128 tokens each, at once", tuple(
        Row(f"{name}, max_model_len {n}: 8 slots' memory, paged / a slot each",
            (f"kv_capacity.{family}.{n}.paged", f"kv_capacity.{family}.{n}.slots", f"kv_capacity.{family}.{n}.ratio"),
            ".3g", card="CPU")
        for family, name in (("nemotron-ld", "Nemotron-LD 8B"), ("diffusion-gemma", "DiffusionGemma 26B-A4B"))
        for n in (2048, 8192, 32768))),
    # docs/benchmarking.md: benchmarks/prefix_lookup_bench.py, the scheduler alone (no model)
    "prefix-lookup": Table("10k+ cached pages, 4k-token prompts", (
        Row("a prompt's page addresses, hashed as it comes (us)", ("address_us_per_request",), ".3g", card="CPU"),
        Row("a prompt's lookup (us); the scheduler's time a command (us)",
            ("lookup_us_per_request", "schedule_us_per_command"), ".3g", card="CPU"),
        Row("the lookups' share of the scheduler's time", ("lookup_share_of_schedule",), ".3g",
            "< 0.05 of a command's host time", "CPU"),
    )),
    # docs/benchmarking.md: benchmarks/grammar_steps.py, the default model on the engine
    "grammar-steps": Table("the default model, 8 requests, a JSON schema", (
        *(Row(f"diffusion, {policy}: tokens a denoising step, with the schema / without",
              (f"grammar.{policy}.tokens_per_step.json", f"grammar.{policy}.tokens_per_step.free"), ".3g", card="CPU")
          for policy in ("threshold", "low_confidence", "leftmost", "entropy_bound")),
        Row("linear_spec: tokens a verify, with the schema / without",
            ("grammar.linear_spec.tokens_per_step.json", "grammar.linear_spec.tokens_per_step.free"), ".3g", card="CPU"),
        *(Row(f"{name}: ms a committed token, with the schema / without",
              (f"grammar.{name}.ms_per_token.json", f"grammar.{name}.ms_per_token.free"), ".3g", card="CPU")
          for name in ("threshold", "ar", "linear_spec")),
        Row("unconstrained requests' tok/s beside constrained neighbours / beside unconstrained ones",
            ("grammar.neighbours_tok_s_ratio",), ".3g", ">= 0.95 (GPU)", "CPU"),
    )),
    # docs/testing.md: scripts/soak_gpu.py (make soak-gpu) on each family's full-size shape
    "soak-gpu": Table("GPU soak", tuple(row for model, name in ((NL, "Nemotron-LD 8B"), (DG, "DiffusionGemma 26B-A4B"))
                                        for row in (
        Row(f"{name}: seconds; requests whole / streamed / with drafts / hung up; tokens",
            tuple(f"soak.{model}.{k}" for k in ("seconds", "requests_whole", "requests_streamed",
                                                 "requests_with_drafts", "hang_ups", "tokens")), COUNT),
        Row("  the 256-way burst: 200s / 429s", (f"soak.{model}.burst_200", f"soak.{model}.burst_429"), COUNT),
        Row("  bad answers; graphs captured / eager steps while soaking",
            (f"soak.{model}.bad_answers", f"soak.{model}.graph_captures", f"soak.{model}.eager_steps"), COUNT),
        Row("  GPU MiB, first third of the samples / last third",
            (f"soak.{model}.gpu_mib_first_third", f"soak.{model}.gpu_mib_last_third"), COUNT),
    ))),
}
