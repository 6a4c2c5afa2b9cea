# Every target bootstraps its own virtual environment: a fresh clone needs only python3 and make.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-reliability test-gpu compile-h200 lint clean

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build from local disk; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	# the playground's browser test drives Debian's Chromium (playwright's own browser downloads are not used)
	test -x /usr/bin/chromium || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) \
		|| echo "could not install chromium: the playground's browser test will skip (and fail under CI)"
	touch $(STAMP)

# Everything but the tests marked `reliability` (deselected in pyproject.toml), the 15 slowest listed at
# the end, then the suite's wall time (it should stay near ten minutes on 2 cores: docs/testing.md).
test: $(STAMP)
	@start=$$(date +%s); $(PY) -m pytest -q --durations=15 tests; status=$$?; \
		echo "make test: pytest took $$(( $$(date +%s) - start )) s"; exit $$status

# The long ones: a soak per family (DLLM_SOAK_S=seconds sets its length), shard faults in a row, a 256-way
# burst, random schemathesis cases (docs/testing.md); -rP prints their figures.
test-reliability: $(STAMP)
	$(PY) -m pytest -q -m reliability -rP tests

# On the GPU host (no registry there): the host's own torch/transformers, Ray from the offline bundle.
test-gpu:
	python3 -m pytest -q -m gpu tests

# No GPU needed: every triton kernel compiled for an H200 (sm_90) by triton's own compiler and ptxas, over
# all the calls the served full-size models (and the GPU tests' tiny ones) make, checked against the
# H200's shared memory, for register spills and for tensor-core MMAs (tests/hopper_kernels.py; `make test`
# runs its --quick subset). Long on a cold triton cache.
compile-h200: $(STAMP)
	$(PY) -m tests.hopper_kernels $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache

# Serve the embedded tiny model (or MODEL=/path/to/checkpoint TP=n; ARGS="max_num_seqs=4 ...") on
# 127.0.0.1:$(PORT) with a local Ray; prints curl examples; Ctrl-C stops it.
PORT ?= 8000
.PHONY: serve bench
serve: $(STAMP)
	MODEL="$(MODEL)" TP="$(TP)" PORT="$(PORT)" $(PY) scripts/serve_local.py $(ARGS)

# On the GPU host, like test-gpu (Ray from the offline bundle): the ratios of docs/performance.md's speed
# tables from one run, and a result file (benchmarks/results.py; $OUT where set). The traffic rows add a
# cold start and a warm restart a family, so one bounded GPU call takes ARGS="--skip traffic", or one
# family's rows (ARGS="--skip gemma" or "--skip nemotron"); the FP8 figures alone (both families' FP8 steps
# and BF16 twins, the profiles, the served seed workload): ARGS="--skip bf16,tp".
bench:
	python3 -m benchmarks.roofline $(ARGS)

# Prefix caching (on / off) and chunked prefill (chunked / unchunked) as a client sees them, each setting on
# a server started cold for it (MODEL=/path/to/checkpoint, default the tiny model), and a result file
# (benchmarks/results.py; $OUT where set). ARGS= more flags or server KEY=VALUE arguments, e.g.
# ARGS="device=cpu --workload conversations" (--help lists them; docs/benchmarking.md).
.PHONY: bench-cache
bench-cache: $(STAMP)
	$(PY) -m benchmarks.cache_bench $(if $(MODEL),--model $(MODEL)) $(ARGS)

# On the GPU host, like bench: the FP8 kernels' sweeps that choose tiles for DiffusionGemma (mostly
# compiles): the experts' grouped kernel per projection at 1-16 canvases, over the dense and the chunked
# weight (the served layout), against the read floor and CUTLASS, then the dense projections' cuBLAS
# against the triton matmul's tiles and K-splits, then its lone canvas's attention (tiles, the split
# combine's tiles, the libraries' kernels).
.PHONY: bench-fp8-kernels
bench-fp8-kernels:
	python3 -m benchmarks.fp8_experts_bench
	python3 -m benchmarks.fp8_gemm_bench --family diffusion-gemma --sweep
	python3 -m benchmarks.attention_bench

# On the GPU host, like bench: speed under real traffic for one family, from one cold start of a served
# full-size shape (one GPU call), and a result file. FAMILY=nemotron-ld|diffusion-gemma; TREE=path serves
# another checkout (before/after with the same client); ARGS= more flags (--help lists them;
# --warm-restart times a second start on the caches the first filled).
.PHONY: traffic soak-gpu
traffic:
	$(if $(FAMILY),,$(error FAMILY=nemotron-ld or FAMILY=diffusion-gemma is required))
	python3 -m benchmarks.traffic --family $(FAMILY) $(if $(TREE),--server-tree $(TREE)) $(ARGS)

# On the GPU host: mixed traffic with streams, drafts, disconnects and one 256-way burst against each
# family's served full-size shape in turn (FAMILY= one only), DLLM_SOAK_S seconds each (default 240);
# DLLM_SOAK_WITHIN_S bounds a family's whole run, start included, to fit a bounded GPU call. Passes with
# no error but the burst's 429s, memory flat and every slot free at the end.
soak-gpu:
	python3 scripts/soak_gpu.py $(if $(FAMILY),--family $(FAMILY)) $(if $(TREE),--server-tree $(TREE)) $(ARGS)
