"""Kept for old command lines: `python bench/make_calib.py OUT.jsonl [flags]` is `quant-serve make-calib OUT.jsonl
[flags]` (server/cli_calib.py; the sources live in quant/calib_data.py and ship with the package)."""
import sys
from pathlib import Path

# bench/ holds a kernels.py: keep this folder off sys.path so that it never shadows the Hugging Face `kernels`
# package transformers imports
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from quant_serve.server.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["make-calib", *sys.argv[1:]]))
