"""The README's examples run as written, from anywhere, with no file outside the package: `plan` and `kernels`
against the configs shipped with it, and the Python example (structured output and a bounded tool call) against
`quant-serve serve` on the bundled demo model."""
import re
import shlex
import subprocess
import sys

import pytest

from quant_serve.server.cli.main import main as cli
from conftest import REPO
from server_common import running_server

README = (REPO / "README.md").read_text()


def _readme_commands(verb: str) -> list[str]:
    return [line.split("  #")[0].strip() for line in README.splitlines() if line.startswith(f"quant-serve {verb} ")]


@pytest.mark.parametrize("verb", ["plan", "kernels"])
def test_plan_and_kernels_examples_run_from_any_folder(verb, tmp_path, monkeypatch):
    commands = _readme_commands(verb)
    assert commands, f"the README shows no `quant-serve {verb}` example"
    monkeypatch.chdir(tmp_path)                 # a user's folder: no ../shared beside it
    for command in commands:
        assert cli(shlex.split(command)[1:]) == 0, command


def test_the_python_example_finishes_on_the_demo_model(tmp_path):
    example = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    assert "max_tokens" in example and "tool_choice" in example
    with running_server(["--num-gpu-blocks-override", "512"], tmp_path / "server.log") as server:
        script = tmp_path / "example.py"
        script.write_text(example.replace("http://127.0.0.1:8000", server.url))
        # bounded: the tool call must end with the call, not run to the context limit
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "word=" in run.stdout, run.stdout
