"""Run metadata for reports: what was measured (model hashes, formats), with what code, where and when."""
import datetime
import hashlib
import platform
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
HASHED_SUFFIXES = (".safetensors", ".json", ".gguf")


def model_hash(model_dir: str | Path) -> str:
    """Short sha256 over the weight files and JSON configs (names and contents), so edited weights hash apart; a
    GGUF checkpoint (a .gguf file or its split parts): over its files."""
    from quant_serve.engine.load.gguf.loader import gguf_files
    h = hashlib.sha256()
    files = gguf_files(model_dir) if Path(model_dir).is_file() else sorted(Path(model_dir).iterdir())
    for path in files:
        if path.is_file() and path.name.endswith(HASHED_SUFFIXES):
            h.update(path.name.encode() + b"\0")
            with path.open("rb") as f:
                while chunk := f.read(16 << 20):
                    h.update(chunk)
    return h.hexdigest()[:12]


def git_commit() -> str | None:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware(device: str) -> dict:
    out = {"cpu": cpu_name(), "cpu_count": torch.get_num_threads(), "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def run_metadata(device: str, argv: list[str] | None = None) -> dict:
    import transformers
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join(["quant-serve", "eval", *(argv or [])]),
        "hardware": hardware(device),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": sys.version.split()[0], "platform": platform.platform(),
    }
