"""Writing a quantized checkpoint without harming anything: into a temporary sibling directory that is renamed into
place only when complete, with the file modes the umask asks for, and a marker file naming what this tool wrote;
--overwrite replaces only such a directory. Debris of killed runs is removed (only ours, only when its process is
gone), and every OS error ends as one OutputError naming the path, never a half-written checkpoint.
"""
import contextlib
import errno
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

logger = logging.getLogger("quant_serve")

MARKER = "quant_serve_checkpoint.json"     # in a finished checkpoint: what wrote it and which files are its own
OWNER = ".quant-serve-owner.json"          # in .NAME.partial-* / .NAME.old-* directories: the process using them
_HINTS = {errno.ENOSPC: "no space left on the device; free some or choose another OUT_DIR",
          errno.EDQUOT: "disk quota exceeded; free some space or choose another OUT_DIR",
          errno.EROFS: "read-only file system; choose another OUT_DIR",
          errno.EACCES: "permission denied; choose a directory you can write",
          errno.EPERM: "operation not permitted there; choose a directory you can write"}


class OutputError(ValueError):
    """The output directory cannot be (over)written; the message is the one line the CLI prints."""


def check_output_dir(out_dir: str | Path, source_dir: str | Path | None, overwrite: bool) -> Path:
    """Refuse an OUT_DIR that is, holds or lies inside the source model, that is not a directory, or that is not
    empty (without --overwrite) or not a checkpoint this tool wrote (with it). -> the resolved OUT_DIR."""
    out = Path(out_dir).expanduser().resolve()
    if source_dir is not None:
        src = Path(source_dir).expanduser().resolve()
        if out == src:
            raise OutputError(f"OUT_DIR {out} is the source model's directory; write the quantized checkpoint to a "
                              "directory of its own")
        if src in out.parents:
            raise OutputError(f"OUT_DIR {out} is inside the source model's directory {src}; choose one outside it")
        if out in src.parents:
            raise OutputError(f"OUT_DIR {out} contains the source model {src}; choose a directory of its own")
    try:
        if out.exists() and not out.is_dir():
            raise OutputError(f"output path {out} exists and is not a directory")
        entries = sorted(out.iterdir()) if out.is_dir() else []
    except OSError as e:
        raise OutputError(describe_os_error(e, out)) from e
    if entries and not overwrite:
        raise OutputError(f"output directory {out} exists and is not empty; pass --overwrite to replace a "
                          "checkpoint quant-serve wrote there")
    if entries:
        problem = _not_replaceable(out, entries)
        if problem:
            raise OutputError(f"--overwrite refuses to replace {out}: {problem}; remove it yourself or choose "
                              "another OUT_DIR")
    return out


def _not_replaceable(out: Path, entries: list[Path]) -> str | None:
    names = [e.name for e in entries]
    if MARKER not in names:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        return f"it holds no {MARKER}, so it is not a checkpoint quant-serve wrote (it holds {shown})"
    try:
        own = set(json.loads((out / MARKER).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MARKER} is unreadable ({e})"
    foreign = [e.name for e in entries
               if e.name != MARKER and (e.name not in own or e.is_symlink() or not e.is_file())]
    if foreign:
        return f"it holds {', '.join(foreign[:5])}, which quant-serve did not write"
    return None


def describe_os_error(e: OSError, out: Path) -> str:
    hint = _HINTS.get(e.errno, e.strerror or str(e))
    where = f" ({e.filename})" if e.filename else ""
    return f"cannot write the quantized checkpoint {out}: {hint}{where}"


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | Path, overwrite: bool, source_dir: str | Path | None = None,
                      info: dict | None = None):
    """Yield a temporary directory beside OUT_DIR; on success write the marker, set the umask's modes and rename
    it to OUT_DIR (replacing the checkpoint there, with --overwrite). On any exception (KeyboardInterrupt
    included) remove it and leave OUT_DIR as it was; OS errors become one OutputError."""
    out = check_output_dir(out_dir, source_dir, overwrite)
    clean_stale_debris(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        _write_owner(tmp)
    except OSError as e:
        raise OutputError(describe_os_error(e, out)) from e
    try:
        yield tmp
        (tmp / OWNER).unlink()
        files = sorted(p.name for p in tmp.iterdir())
        marker = {"written_by": "quant-serve quantize", "version": _version(), "files": files} | (info or {})
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        apply_umask_modes(tmp)
        check_output_dir(out, source_dir, overwrite)         # still safe to replace (nothing appeared meanwhile)
        _replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise OutputError(describe_os_error(e, out)) from e
        raise


def _replace(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        _write_owner(old)
        os.rename(out, old / "d")
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_owner(path: Path) -> None:
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    (path / OWNER).write_text(json.dumps(owner) + "\n")


def clean_stale_debris(out: Path) -> None:
    """Remove .NAME.partial-* / .NAME.old-* directories beside OUT_DIR that a quantize run on this host left when
    it was killed (its process is gone). Directories without our owner file, or of a live process or another
    host, stay."""
    try:
        candidates = [p for pattern in (f".{out.name}.partial-*", f".{out.name}.old-*")
                      for p in out.parent.glob(pattern) if p.is_dir() and not p.is_symlink()]
    except OSError:
        return
    for path in candidates:
        try:
            owner = json.loads((path / OWNER).read_text())
            pid, host = int(owner["pid"]), str(owner["host"])
        except (OSError, ValueError, KeyError, TypeError):
            logger.warning("leaving %s: it looks like debris of an interrupted quantize run, but it has no %s "
                           "saying which process wrote it; remove it yourself", path, OWNER)
            continue
        if host == socket.gethostname() and not _pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed %s, left by a quantize run (pid %d) that was killed", path, pid)


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":
        return True                       # no cheap liveness check: never remove
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def current_umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)                # no /proc: read it by setting it (the CLI is single-threaded here)
    os.umask(mask)
    return mask


def apply_umask_modes(root: Path) -> None:
    """Directories 0777 and files 0666 less the umask (0755 / 0644 with the usual 022), as `cp` or `mkdir` would
    create them: mkdtemp makes 0700, safetensors writes 0600, and copies keep the source's read-only bits."""
    mask = current_umask()
    os.chmod(root, 0o777 & ~mask)
    for path in root.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("quant-serve")
    except PackageNotFoundError:
        return "unknown"


class ShardWriter:
    """Tensors -> model.safetensors, or model-0000i-of-0000N.safetensors + index when over max_bytes."""

    def __init__(self, out_dir: Path, max_bytes: int):
        self.out_dir, self.max_bytes = Path(out_dir), max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.seen: set[str] = set()
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.seen:
            raise ValueError(f"tensor {name} written twice")
        self.seen.add(name)
        t = tensor.detach().to("cpu").contiguous()
        self.total_bytes += t.nbytes
        if self.pending and self.pending_bytes + t.nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = t
        self.pending_bytes += t.nbytes

    def _flush(self) -> None:
        path = self.out_dir / f"shard-{len(self.shards)}.tmp"
        try:
            save_file(self.pending, str(path), metadata={"format": "pt"})
        except OSError:
            raise
        except Exception as e:            # safetensors reports I/O errors (a full disk) as its own error type
            code = re.search(r"os error (\d+)", str(e))
            if code:
                raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from e
            raise OutputError(f"cannot write {path}: {e}") from e
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        if n == 1:
            os.rename(self.out_dir / "shard-0.tmp", self.out_dir / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(self.out_dir / f"shard-{i}.tmp", self.out_dir / final)
            weight_map |= {name: final for name in names}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
