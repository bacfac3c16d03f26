"""Kept for old command lines: `python bench/make_calib.py OUT.jsonl [flags]` is `quant-serve make-calib OUT.jsonl
[flags]` (server/cli/calib.py; the sources live in quant/calib_data.py and ship with the package)."""
import sys

from quant_serve.server.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["make-calib", *sys.argv[1:]]))
