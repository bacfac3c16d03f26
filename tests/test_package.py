"""Package hygiene: everything installs under one name, `quant_serve`, so nothing shadows a package that
transformers or another dependency imports (transformers >= 5.2x imports the Hugging Face `kernels` package), even
from the checkout's root; and the rooms import only in the allowed direction (kernels <- quant <- engine <- eval,
server)."""
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


def test_we_install_one_top_level_name():
    owners = importlib.metadata.packages_distributions()
    ours = sorted(name for name, dists in owners.items()
                  if any(d.lower().replace("_", "-") == "quant-serve" for d in dists))
    assert ours == ["quant_serve"], ours
    others = [d for d in owners["quant_serve"] if d.lower().replace("_", "-") != "quant-serve"]
    assert not others, f"quant_serve is also provided by {others}"


@pytest.mark.parametrize("cwd", [REPO, Path("/")], ids=["checkout-root", "elsewhere"])
def test_transformers_and_its_kernels_package_beside_ours(cwd):
    """From the checkout's root (the worst case: `python -c` puts the root folders on sys.path) and from elsewhere,
    our packages, transformers and the Hugging Face `kernels` package (when installed) import side by side."""
    code = (
        "import importlib.util, sys\n"
        "import quant_serve.kernels.attention.reference, quant_serve.engine.llm_engine, quant_serve.server.app\n"
        "import transformers\n"
        "from transformers import AutoConfig, Qwen2ForCausalLM\n"
        "import torch\n"
        "cfg = AutoConfig.for_model('qwen2', hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
        "    num_attention_heads=4, num_key_value_heads=2, vocab_size=64)\n"
        "m = Qwen2ForCausalLM(cfg)\n"
        "assert m(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 64)\n"
        "import builtins; assert callable(builtins.eval)\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "if spec is not None and spec.origin is not None:\n"
        "    import kernels\n"
        "    assert not kernels.__file__.startswith(%(repo)r), kernels.__file__\n"
        "    assert hasattr(kernels, 'get_kernel'), 'the Hugging Face kernels package lost its API'\n"
        "    print('hf-kernels', end=' ')\n"
        "leaked = [n for n in ('engine', 'kernels', 'quant', 'server', 'eval')\n"
        "          if str(getattr(sys.modules.get(n), '__file__', None) or '').startswith(%(repo)r)]\n"
        "assert not leaked, leaked\n"
        "print('ok')\n") % {"repo": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_root_folders_are_no_regular_packages():
    """An __init__.py in a root folder would make it shadow a same-named package from the checkout's root."""
    for room in OURS:
        assert not (REPO / room / "__init__.py").exists(), room


def _room(module: str) -> str:
    """quant_serve.engine.config -> engine; anything else -> its top-level name."""
    parts = module.split(".")
    return parts[1] if parts[0] == "quant_serve" and len(parts) > 1 else parts[0]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {_room(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(_room(node.module))
    return names


@pytest.mark.parametrize("room", OURS)
def test_import_direction(room):
    for path in (REPO / room).rglob("*.py"):
        if room == "server" and path.relative_to(REPO).parts[1] == "cli":
            continue  # the CLI may import every layer
        bad = (_imports(path) & set(OURS)) - ALLOWED[room] - {room}
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def test_pure_python_scheduling_modules_do_not_import_torch():
    code = ("import sys, quant_serve.engine.core.scheduler, quant_serve.engine.core.block_manager, quant_serve.engine.core.sequence\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def _module_graph() -> dict[str, set[str]]:
    """quant_serve module -> the quant_serve modules it imports (function-level imports included)."""
    mods = {}
    for room in OURS:
        for path in (REPO / room).rglob("*.py"):
            name = ".".join(("quant_serve",) + path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            mods[name] = path
    graph = {name: set() for name in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[name] |= {t for t in targets if t in mods and t != name}
    return graph


def test_no_import_circles():
    graph, state, path = _module_graph(), {}, []

    def visit(module):                      # depth-first; a module met again while on the path closes a circle
        state[module] = "open"
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                raise AssertionError("import circle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        path.pop()
        state[module] = "done"
    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert len(graph) > 100


@pytest.mark.parametrize("room", ["kernels", "quant", "engine"])
def test_no_environment_reads_below_the_cli(room):
    """Options are configuration (EngineConfig, KernelOptions), set from the CLI: nothing in the kernels, the
    quantizers or the engine reads the environment."""
    for path in (REPO / room).rglob("*.py"):
        text = path.read_text()
        assert "os.environ" not in text and "getenv(" not in text, path.relative_to(REPO)


def test_every_package_folder_is_in_the_wheel(tmp_path):
    """A regular install (`pip install .`, a wheel) carries every module and data file of the rooms: the editable
    install CI and developers use reads the checkout and would hide a folder the wheel misses."""
    import shutil
    import zipfile
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the files of the source tree are not known")
    source = tmp_path / "src"                         # the tree a clean clone has (no stale build/ folder)
    for name in listed.stdout.splitlines():
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    # no build isolation: setuptools comes with the test extra, so this needs no network
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            str(source), "-w", str(tmp_path)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel, = tmp_path.glob("quant_serve-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    data = ("/demo_model/", "/tasks/", "/configs/")
    wanted = [name for name in listed.stdout.splitlines() if name.split("/")[0] in OURS and (REPO / name).is_file()
              and "__pycache__" not in name and (name.endswith((".py", ".toml")) or any(d in name for d in data))]
    missing = [name for name in wanted if f"quant_serve/{name}" not in shipped]
    assert not missing, f"the wheel misses {len(missing)} files, e.g. {missing[:5]}"
    assert len(wanted) > 150
