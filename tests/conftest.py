import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_nemotron(tmp_path_factory):
    """A tiny Nemotron-Labs-Diffusion checkpoint in the real format (sharded like the published one)."""
    from model.tiny import write_nemotron_ld

    return write_nemotron_ld(tmp_path_factory.mktemp("tiny-nemotron-ld"), seed=0, shards=2)
