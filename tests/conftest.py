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


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    assert (TINY / "config.json").is_file(), f"fixture model missing at {TINY}"
    return TINY
