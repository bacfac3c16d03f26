import os
from pathlib import Path

import pytest

# The kernels' CPU tests run Triton in interpreter mode; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
TINY = SHARED / "models" / "tiny-qwen2"
TINY_AWQ = SHARED / "models" / "tiny-qwen2-awq"
TINY_CT = SHARED / "models" / "tiny-qwen2-w4a16-ct"
DATA = SHARED / "data"


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread in every test module: on a busy 2-core machine (and beside the server processes the
    tests start) a second thread turns each small op into a wait for a core (one attention call: 39 ms with two
    threads, 0.15 ms with one)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    assert (TINY / "config.json").is_file(), f"fixture model missing at {TINY}"
    return TINY
