import sys

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # The modules on the session's shared Ray + Serve (tests/serve_harness.py) run last, in their order;
    # before them the modules with triton-interpreter snippets, whose snippets start with the session and
    # run in the background meanwhile (tests/interpreter.py), so their tests find them done
    snippets = {item.path for item in items if item.get_closest_marker("interpreted")}
    items.sort(key=lambda item: ("shared_serve" in item.keywords, item.path in snippets))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    from tests.interpreter import start_session_ahead

    start_session_ahead(item)


def pytest_sessionfinish(session, exitstatus):
    from tests.interpreter import stop_ahead

    stop_ahead()
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
