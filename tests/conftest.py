import os
import sys
from pathlib import Path

# One intra-op thread here and, inherited, in the processes the session starts (the interpreter's run, Ray's
# workers, servers, TP ranks): they keep both of a CI machine's cores busy, and a second OpenMP thread then
# waits for a core at every parallel region, of which a tiny model's step has thousands (the first module
# took 230 s beside the interpreter's run with two threads, 10 s with one)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# tests/interpreted runs under triton's CPU interpreter, which is chosen when triton is imported: it is
# collected only with TRITON_INTERPRET=1 in the environment, as the subprocess of
# tests/test_interpreted_kernels.py runs it; this session never imports it
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpreted"]
INTERPRETED_RUN = Path(__file__).with_name("test_interpreted_kernels.py")
_interpreted_run = None   # that test's module, once the session's first test has started its subprocess
BESIDE_RUN = Path(__file__).with_name("test_beside.py")
_beside_run = None        # that test's module, where it was handed tests to run beside the session


def _hand_beside(config, items) -> None:
    """The selected tests of test_beside.MODULES leave the session for the run beside it, where its test is
    selected, on a machine without a GPU (tests/test_beside.py). A run beside the session runs exactly the
    tests it was handed."""
    global _beside_run
    ids = os.environ.get("DLLM_BESIDE_IDS")
    if ids:
        handed = set(Path(ids).read_text().splitlines())
        items[:] = [item for item in items if item.nodeid in handed]
        return
    beside = next((item for item in items if item.path == BESIDE_RUN), None)
    if beside is None or config.option.collectonly or torch.cuda.is_available():
        return
    module = beside.module
    module.node_ids = [item.nodeid for item in items if item.path.name in module.MODULES]
    if module.node_ids:
        items[:] = [item for item in items if item.path.name not in module.MODULES]
        _beside_run = module


@pytest.hookimpl(trylast=True)   # after `-m` deselects (pyproject's addopts): only selected tests go beside
def pytest_collection_modifyitems(config, items):
    _hand_beside(config, items)
    # The modules on the session's shared Ray + Serve (tests/serve_harness.py) run last but two, in their
    # order; then the test awaiting the run beside the session (tests/test_beside.py); last, the test
    # awaiting the triton-interpreter tests' subprocess, which starts with the session and runs in the
    # background meanwhile
    items.sort(key=lambda item: (item.path == INTERPRETED_RUN, item.path == BESIDE_RUN,
                                 "shared_serve" in item.keywords))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    # the session's first test starts the triton-interpreter tests' subprocess where the test awaiting it
    # is selected, so that it runs beside the whole session (tests/test_interpreted_kernels.py)
    global _interpreted_run
    if _interpreted_run is None:
        _interpreted_run = False
        for other in item.session.items:
            if other.path == INTERPRETED_RUN and not other.get_closest_marker("skip"):
                _interpreted_run = other.module
                _interpreted_run.start_ahead()
                break
        if _beside_run:   # after the interpreter's run: the two take turns at the core the session leaves idle
            run = getattr(_interpreted_run, "_run", None) if _interpreted_run else None
            _beside_run.start_ahead(run[0].pid if run else None)


def pytest_sessionfinish(session, exitstatus):
    if _interpreted_run:
        _interpreted_run.stop_ahead()   # a session stopped before its test awaited it
    if _beside_run:
        _beside_run.stop_ahead()
    harness = sys.modules.get("tests.serve_harness")   # imported by a module that served (it imports ray:
    if harness is not None:                            # the GPU host runs kernel tests without Ray)
        harness.stop_shared_serve()


@pytest.fixture(scope="session")
def tiny_nemotron(tmp_path_factory):
    """A tiny Nemotron-Labs-Diffusion checkpoint in the real format (sharded like the published one)."""
    from model.tiny import write_nemotron_ld

    return write_nemotron_ld(tmp_path_factory.mktemp("tiny-nemotron-ld"), seed=0, shards=2)


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory):
    """A tiny DiffusionGemma checkpoint in the real format (one shard)."""
    from model.tiny import write_diffusion_gemma

    return write_diffusion_gemma(tmp_path_factory.mktemp("tiny-gemma"), seed=0)


@pytest.fixture(scope="session")
def tiny_fp8_nemotron(tmp_path_factory):
    """The tiny Nemotron-Labs-Diffusion checkpoint as compressed-tensors FP8-dynamic (2 shards)."""
    from model.tiny import write_nemotron_ld

    return write_nemotron_ld(tmp_path_factory.mktemp("tiny-fp8-nemotron-ld"), seed=0, shards=2, quantize="fp8-dynamic")


@pytest.fixture(scope="session")
def tiny_fp8_gemma(tmp_path_factory):
    """The tiny DiffusionGemma checkpoint as compressed-tensors FP8-dynamic (2 shards), in the format of
    RedHatAI/diffusiongemma-26B-A4B-it-FP8-dynamic."""
    from model.tiny import write_diffusion_gemma

    return write_diffusion_gemma(tmp_path_factory.mktemp("tiny-fp8-gemma"), seed=0, shards=2, quantize="fp8-dynamic")


@pytest.fixture(scope="session")
def fp8_checkpoints(tiny_fp8_nemotron, tiny_fp8_gemma, tmp_path_factory):
    """family -> (the tiny FP8 checkpoint, its twin as compressed-tensors decompresses it)."""
    from tests.fp8_reference import twin_checkpoint

    return {family: (d, twin_checkpoint(d, tmp_path_factory.mktemp(f"{family}-twin") / "twin"))
            for family, d in (("nemotron", tiny_fp8_nemotron), ("gemma", tiny_fp8_gemma))}
