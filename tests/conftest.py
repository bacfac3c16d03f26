"""Which model a test should ask for:

- random_model (random_awq, random_ct): a test that needs a checkpoint to load, plan, quantize, break or serve, not a
  good model. Tiny, so cheap; made here once per session.
- trained_model: a test whose meaning needs a model that writes sensible text (greedy comparisons without near-ties,
  definitions, copying for speculation, realistic activations): the bundled demo model in FP16. Made once per session.
- DEMO_MODEL_DIR (quant_serve.engine.load.demo): the same trained model as our INT4 AWQ checkpoint, and its tokenizer.
- tiny_trained, tiny_awq_autoawq, tiny_ct, val_txt: ../shared, only for what no tool of ours can make (the third
  parties' checkpoints) and for tiny-qwen2's own figures (perplexity, quantizer quality on unrounded weights). They
  skip, naming the path, where ../shared is missing.
- heldout_text: a few thousand tokens of text in the trained model's styles (tests/data/heldout.txt).
"""
import json
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
TESTS = REPO / "tests"
# The project's shared fixtures (models/tiny-qwen2*, data/) sit beside the checkout; QUANT_SERVE_SHARED points
# elsewhere. A clone has none of them: the tests that need them request the fixtures below, which skip with the
# exact path when it is missing. Everything else runs on what tests/ builds (tests/fixtures.py) or holds.
SHARED = Path(os.environ.get("QUANT_SERVE_SHARED", REPO.parent / "shared")).resolve()
TINY = SHARED / "models" / "tiny-qwen2"
TINY_AWQ = SHARED / "models" / "tiny-qwen2-awq"
TINY_CT = SHARED / "models" / "tiny-qwen2-w4a16-ct"
DATA = SHARED / "data"
# The published configs (no weights) the package ships, with a typical INT4 quantization_config: memory and kernel
# plans on them speak for the real deployments.
QWEN_7B = REPO / "engine" / "load" / "configs" / "qwen2.5-7b-instruct"
LLAMA_8B = REPO / "engine" / "load" / "configs" / "llama-3.1-8b-instruct"
HELDOUT = TESTS / "data" / "heldout.txt"


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


def pytest_report_header(config):
    state = "found" if has_weights(TINY) else \
        "partial: the few tests that need what is missing are skipped" if SHARED.is_dir() else \
        "missing: the few tests that need them are skipped"
    return f"shared fixtures: {SHARED} ({state}); Triton: " + \
        ("interpreter (no CUDA GPU)" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled") + \
        f"; GPU profile: {config.getoption('--gpu-profile')}"


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the GPU machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread in every test module: on a busy 2-core machine (and beside the server processes the
    tests start) a second thread turns each small op into a wait for a core (one attention call: 39 ms with two
    threads, 0.15 ms with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def has_weights(model_dir: Path) -> bool:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return all((model_dir / f).is_file() for f in set(json.loads(index.read_text())["weight_map"].values()))
    return (model_dir / "model.safetensors").is_file()


def _shared(path: Path, what: str, present: bool) -> Path:
    if not present:
        pytest.skip(f"needs {what} at {path}: place the project's shared/ beside the checkout or set "
                    "QUANT_SERVE_SHARED=DIR")
    return path


# ---- from ../shared: only what tests cannot make ---------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_trained() -> Path:
    """tiny-qwen2 itself, FP16 as trained: for figures of that model (its perplexity) and for quantizers, whose
    comparisons need weights that are not already on an INT4 grid (the demo model's are)."""
    return _shared(TINY, "the trained tiny-qwen2 (FP16)", has_weights(TINY))


@pytest.fixture(scope="session")
def tiny_awq_autoawq() -> Path:
    """AutoAWQ's quantization of tiny-qwen2: a third party's checkpoint, which only that tool can write."""
    return _shared(TINY_AWQ, "AutoAWQ's tiny-qwen2-awq", has_weights(TINY_AWQ))


@pytest.fixture(scope="session")
def tiny_ct() -> Path:
    """llm-compressor's compressed-tensors quantization of tiny-qwen2 (GPTQ W4A16)."""
    return _shared(TINY_CT, "llm-compressor's tiny-qwen2-w4a16-ct", has_weights(TINY_CT))


@pytest.fixture(scope="session")
def val_txt() -> Path:
    """The held-out split of tiny-qwen2's corpus (about 180k tokens), for the model's own perplexity figures."""
    return _shared(DATA / "val.txt", "the held-out text val.txt", (DATA / "val.txt").is_file())


# ---- made here, once per session ---------------------------------------------------------------------------

def _read_only(path: Path) -> Path:
    """Session fixtures are shared by every test: files read-only, as ../shared's are, so that no test edits them."""
    for f in path.iterdir():
        f.chmod(0o444)
    return path


@pytest.fixture(scope="session")
def random_model(tmp_path_factory) -> Path:
    """A random-weight Qwen2 laid out like tiny-qwen2 (fixtures.RANDOM_QWEN2: 4 layers, hidden 128, its tokenizer,
    FP16 in 3 shards with an index): for tests that need a model, not a good one."""
    from fixtures import write_random_qwen2
    return _read_only(write_random_qwen2(tmp_path_factory.mktemp("random-qwen2")))


@pytest.fixture(scope="session")
def random_awq(random_model, tmp_path_factory) -> Path:
    """random_model quantized by our RTN into AutoAWQ's gemm format (4-bit, g128, zero point)."""
    from fixtures import write_int4
    return _read_only(write_int4(random_model, tmp_path_factory.mktemp("int4") / "random-qwen2-awq", "awq", False))


@pytest.fixture(scope="session")
def random_ct(random_model, tmp_path_factory) -> Path:
    """random_model quantized by our RTN into compressed-tensors pack-quantized (symmetric, g128)."""
    from fixtures import write_int4
    return _read_only(write_int4(random_model, tmp_path_factory.mktemp("int4") / "random-qwen2-ct",
                                 "compressed-tensors", True))


@pytest.fixture(scope="session")
def trained_model(tmp_path_factory) -> Path:
    """The trained tiny model in FP16 (the bundled demo model dequantized: tiny-qwen2's architecture, tokenizer and
    behaviour, its weights up to INT4 rounding): for tests whose meaning needs a model that writes sensible text."""
    from fixtures import write_trained_fp16
    return _read_only(write_trained_fp16(tmp_path_factory.mktemp("trained") / "tiny-qwen2-demo-fp16"))


@pytest.fixture(scope="session")
def heldout_text() -> str:
    """About 4,500 tokens of text in the trained model's styles, never trained on (tests/data/README.md)."""
    return HELDOUT.read_text()


@pytest.fixture(scope="session")
def text_ids(trained_model, heldout_text) -> list[int]:
    """heldout_text in the trained model's tokens (prompts cut from it share no prefix unless a test makes one)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(trained_model)).encode(heldout_text)


@pytest.fixture(scope="session")
def arch_models(tmp_path_factory):
    """name -> random_archs.CONFIGS[name] saved as a random-weight checkpoint (fp32; norms and biases random too,
    so that a missed (1 + w) or a dropped norm shows), made on first use."""
    from random_archs import random_model_dir
    cache = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = random_model_dir(name, tmp_path_factory.mktemp(name))
        return cache[name]
    return get


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory, trained_model):
    """The `quant-serve serve` process most server tests share: the trained model, API key (from a file), two
    names, 256 blocks."""
    from server_common import KEY, running_server
    directory = tmp_path_factory.mktemp("server")
    (directory / "api-key").write_text(KEY + "\n")
    args = [str(trained_model), "--num-gpu-blocks-override", "256", "--max-model-len", "512", "--max-num-seqs", "16",
            "--dtype", "float32", "--served-model-name", "tiny", "tiny-alias", "--api-key-file",
            str(directory / "api-key")]
    with running_server(args, directory / "server.log") as server:
        yield server


@pytest.fixture(scope="session")
def client(shared_server):
    import openai

    from server_common import KEY
    return openai.OpenAI(base_url=shared_server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
