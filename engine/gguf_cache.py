"""transformers' config and tokenizer of a GGUF file, built once and kept on disk. Building them is slow for a large
vocabulary: AutoConfig and AutoTokenizer each parse every metadata field with gguf's GGUFReader, and a SentencePiece
vocabulary without merges has them rebuilt (a synthetic 262k-token Gemma 3-style vocabulary on a 2-core box: 21 s
config, 26 s tokenizer; from the cache 0.03 s and 1.3 s; 36 s, 56 s and 0.03 s, 5-7 s while the box was busy).

An entry is a directory that save_pretrained wrote, named after the file, what it holds and a key of the file's size
and modification time and the transformers version, so a changed file or another transformers builds anew. It lives
beside the file (.quant-serve/ in the file's directory) or, where that cannot be written or the file is a link (the
hub cache's snapshots), under ~/.cache/quant-serve/gguf/. It is written to a temporary directory and renamed into
place, so a reader sees a whole entry or none."""
import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Callable

logger = logging.getLogger("quant_serve")

CACHE_FORMAT = 1                     # bump when what an entry holds changes
BESIDE = ".quant-serve"
DEFAULT_ROOT = Path("~/.cache/quant-serve/gguf")


def _key(file: Path) -> dict:
    import transformers
    stat = file.stat()
    return {"file": str(file.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "transformers": transformers.__version__, "format": CACHE_FORMAT}


def entry_name(file: Path, kind: str) -> str:
    digest = hashlib.sha256(json.dumps(_key(file), sort_keys=True).encode()).hexdigest()[:16]
    return f"{file.name}.{kind}-{digest}"


def cache_roots(file: Path, fallback: Path = DEFAULT_ROOT) -> list[Path]:
    """Where entries of `file` may live, in the order they are tried."""
    by_path = hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:16]
    home = Path(fallback).expanduser() / by_path
    return [home] if file.is_symlink() else [file.parent / BESIDE, home]


def cached(file: Path, kind: str, build: Callable, save: Callable, load: Callable,
           fallback: Path = DEFAULT_ROOT):
    """load(entry) of the first valid entry; otherwise build(), saved with save(obj, directory) and loaded back, so
    that the first start and the later ones get the same object (transformers keeps a saved tokenizer's add_bos_token
    in its post-processor, not in the attribute). A cache that cannot be read or written costs a build, never the
    start."""
    file = Path(file)
    name = entry_name(file, kind)
    roots = cache_roots(file, fallback)
    for root in roots:
        entry = root / name
        if (entry / "meta.json").is_file():
            try:
                return load(entry)
            except Exception as e:       # a damaged entry: away with it, and build again
                logger.warning("cannot load the cached GGUF %s in %s (%s: %s); building it again", kind, entry,
                               type(e).__name__, e)
                shutil.rmtree(entry, ignore_errors=True)
    obj = build()
    for root in roots:
        try:
            _write(root, name, kind, file, obj, save)
            return load(root / name)
        except Exception as e:           # a directory we may not write, a full disk: the next start builds again
            logger.info("cannot cache the GGUF %s in %s (%s: %s)", kind, root, type(e).__name__, e)
    return obj


def _write(root: Path, name: str, kind: str, file: Path, obj, save: Callable) -> None:
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        tmp.chmod(0o755)                 # mkdtemp's 0700 would hide the entry from the file's other users
        save(obj, tmp)
        (tmp / "meta.json").write_text(json.dumps({"kind": kind, **_key(file)}, indent=1))
        entry = root / name
        if entry.exists() and not (entry / "meta.json").is_file():   # incomplete (by hand): ours replaces it
            shutil.rmtree(entry, ignore_errors=True)
        try:
            tmp.rename(entry)
        except OSError:
            if not (entry / "meta.json").is_file():     # not another process's complete entry: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prefix = name.rsplit("-", 1)[0] + "-"
    for stale in root.iterdir():         # entries of older versions of the file (or of transformers)
        if stale.name.startswith(prefix) and stale.name != name:
            shutil.rmtree(stale, ignore_errors=True)
    logger.info("cached the GGUF %s of %s in %s", kind, file.name, root / name)
