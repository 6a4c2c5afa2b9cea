# Every target bootstraps its own virtual environment: a fresh clone needs only python3 and make.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-gpu lint clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build from local disk; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# On the GPU host (no registry there): the host's own torch/transformers, Ray from the offline bundle.
test-gpu:
	python3 -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) .pytest_cache
