"""Where Triton has no wheel (macOS, Windows) the package imports and the CPU path runs: generate on the bundled demo
model and the server's app, in a process where `import triton` fails as it does there."""
import subprocess
import sys

BLOCK_TRITON = (
    "import sys, importlib.abc\n"
    "class NoTriton(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'triton' or name.startswith('triton.'):\n"
    "            raise ImportError('No module named ' + repr(name))\n"
    "sys.meta_path.insert(0, NoTriton())\n"
    "for name in [n for n in sys.modules if n == 'triton' or n.startswith('triton.')]:\n"
    "    del sys.modules[name]\n")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TRITON + code], capture_output=True, text=True, timeout=300)


def test_cli_generate_and_server_app_without_triton():
    result = _run(
        "import io, contextlib, pathlib\n"
        "from quant_serve.kernels import triton_compat\n"
        "assert not triton_compat.HAS_TRITON\n"
        "from quant_serve.server.cli.main import main\n"
        "import quant_serve.server.app, quant_serve.kernels.matmul.frag.tma, quant_serve.kernels.matmul.frag.mma\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    rc = main(['generate', '--chat', '--prompt', 'What does \"lantern\" mean?', '--max-tokens', '8',\n"
        "               '--temperature', '0'])\n"
        "assert rc == 0, rc\n"
        "assert 'triton' not in sys.modules, 'something imported triton'\n"
        "print('TEXT:' + out.getvalue())\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TEXT:lantern (" in result.stdout.lower().replace("text:", "TEXT:"), result.stdout[-500:]


def test_a_triton_kernel_without_triton_says_what_is_missing():
    result = _run(
        "import torch\n"
        "from quant_serve.kernels import norm_act\n"
        "x = torch.randn(2, 8)\n"
        "assert torch.equal(norm_act.rms_norm(x, torch.ones(8), 1e-6), norm_act.rms_norm_ref(x, torch.ones(8), 1e-6))\n"
        "try:\n"
        "    norm_act.rms_norm_triton(x, torch.ones(8), 1e-6)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Triton is not installed" in result.stdout, result.stdout
