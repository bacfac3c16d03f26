"""Package hygiene: our top-level names shadow nothing that transformers or other deps import, and the rooms
import only in the allowed direction (kernels <- quant <- engine <- eval, server)."""
import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = ("engine", "kernels", "quant", "server", "eval")
ALLOWED = {"kernels": set(), "quant": {"kernels"}, "engine": {"quant", "kernels"},
           "eval": {"engine", "quant", "kernels"}, "server": {"engine", "quant", "kernels", "eval"}}


def test_no_installed_distribution_provides_our_top_level_names():
    owners = importlib.metadata.packages_distributions()
    for name in OURS:
        others = [d for d in owners.get(name, []) if d.lower().replace("_", "-") != "quant-serve"]
        assert not others, f"top-level package {name!r} is also provided by {others}"


def test_transformers_beside_our_packages():
    code = (
        "import engine, kernels, quant, server, eval\n"
        "import transformers\n"
        "from transformers.utils import import_utils\n"
        "assert not import_utils.is_kernels_available(), 'transformers mistakes our kernels for HF kernels'\n"
        "from transformers import AutoConfig, AutoTokenizer, Qwen2ForCausalLM, LlamaForCausalLM\n"
        "import torch\n"
        "cfg = AutoConfig.for_model('qwen2', hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
        "    num_attention_heads=4, num_key_value_heads=2, vocab_size=64)\n"
        "m = Qwen2ForCausalLM(cfg)\n"
        "assert m(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 64)\n"
        "import builtins; assert callable(builtins.eval)\n"
        "import kernels.attention_ref, engine.llm_engine\n"
        "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("room", OURS)
def test_import_direction(room):
    for path in (REPO / room).rglob("*.py"):
        if room == "server" and path.name.startswith("cli"):
            continue  # the CLI may import every layer
        bad = (_imports(path) & set(OURS)) - ALLOWED[room] - {room}
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def test_pure_python_scheduling_modules_do_not_import_torch():
    code = ("import sys, engine.scheduler, engine.block_manager, engine.sequence\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
