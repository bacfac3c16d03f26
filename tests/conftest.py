import os
from pathlib import Path

import pytest
import torch

# Triton picks compiled or interpreted kernels when a kernel is decorated (at import), so the mode is chosen here,
# before any kernel module is imported, from what the machine has: with a CUDA GPU the kernel tests put their
# tensors on it and run compiled; without one they run on CPU tensors under Triton's interpreter. Nobody has to
# set TRITON_INTERPRET (an explicit value still wins).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
# The project's shared fixtures (models/tiny-qwen2*, data/, configs/) sit beside the checkout; QUANT_SERVE_SHARED
# points elsewhere. Tests that need them are skipped with the exact path when they are missing.
SHARED = Path(os.environ.get("QUANT_SERVE_SHARED", REPO.parent / "shared")).resolve()
TINY = SHARED / "models" / "tiny-qwen2"
TINY_AWQ = SHARED / "models" / "tiny-qwen2-awq"
TINY_CT = SHARED / "models" / "tiny-qwen2-w4a16-ct"
DATA = SHARED / "data"


def pytest_addoption(parser):
    parser.addoption("--gpu-profile", default="this",
                     help="run the GPU tests under a GPU profile (kernels/gpu.py), e.g. a10: the sm86 kernel plan "
                          "on this GPU (no TMA / wgmma / PDL, 99 KB shared memory, e4m3 KV in software)")


GPU_PROFILE = ["this"]   # --gpu-profile, read by helpers.make_engine and the session fixture below


def pytest_configure(config):
    GPU_PROFILE[0] = config.getoption("--gpu-profile")


@pytest.fixture(scope="session", autouse=True)
def kernels_under_gpu_profile():
    """Every CUDA device runs the kernels under --gpu-profile (engines the tests build pass it too)."""
    if torch.cuda.is_available():
        from quant_serve.kernels.gpu import KernelOptions, configure
        for index in range(torch.cuda.device_count()):
            configure(index, KernelOptions(profile=GPU_PROFILE[0]))
    yield


def _missing_fixtures(path: Path) -> list[Path]:
    """The shared fixtures a test file needs that are not here: the folders its `from conftest import` names
    (TINY, TINY_AWQ, TINY_CT, DATA, SHARED); the whole folder for files that reach it through helpers or the
    shared server (those fall back to the bundled demo model when only the models are missing)."""
    import re
    text = path.read_text(errors="replace")
    named = {"TINY": TINY, "TINY_AWQ": TINY_AWQ, "TINY_CT": TINY_CT, "DATA": DATA, "SHARED": SHARED}
    wanted = [named[n] for line in re.findall(r"^from conftest import (.+)$", text, re.M)
              for n in (x.strip() for x in line.split(",")) if n in named]
    if "from helpers import" in text or "shared_server" in text or \
            "client" in text.split("from test_server_common import", 1)[-1][:300]:
        wanted.append(SHARED)
    return [p for p in dict.fromkeys(wanted) if not p.exists()]


def pytest_report_header(config):
    state = "found" if (TINY / "config.json").is_file() else \
        "partial: tests that need what is missing are skipped" if SHARED.is_dir() else \
        "MISSING: tests that need them are skipped"
    return f"shared fixtures: {SHARED} ({state}); Triton: " + \
        ("interpreter (no CUDA GPU)" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled") + \
        f"; GPU profile: {config.getoption('--gpu-profile')}"


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the GPU machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    missing: dict[Path, list[Path]] = {}
    for item in items:
        path = Path(str(item.fspath))
        if path not in missing:
            missing[path] = _missing_fixtures(path)
        if missing[path]:
            item.add_marker(pytest.mark.skip(
                reason=f"needs the shared fixtures {', '.join(map(str, missing[path]))}: place the project's shared/ "
                       "beside the checkout or set QUANT_SERVE_SHARED=DIR"))


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread in every test module: on a busy 2-core machine (and beside the server processes the
    tests start) a second thread turns each small op into a wait for a core (one attention call: 39 ms with two
    threads, 0.15 ms with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    assert (TINY / "config.json").is_file(), f"fixture model missing at {TINY}"
    return TINY
