"""GGUF repositories on the Hugging Face hub: `org/name:QUANT` picks one quantization of a repo that holds many
(llama.cpp's `-hf org/name:Q4_K_M`, vLLM's `repo_id:quant_type`), downloads only its file or split parts, and
works offline from the local hub cache (HF_HUB_OFFLINE=1, or no network) once they were fetched."""
import logging
import re
from pathlib import Path

logger = logging.getLogger("quant_serve")

_SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def split_quant_tag(model: str) -> tuple[str, str | None]:
    """'org/name:Q4_K_M' -> ('org/name', 'Q4_K_M'); anything without a tag -> (model, None)."""
    repo, sep, tag = model.partition(":")
    if not sep or repo.count("/") != 1 or not tag or "/" in tag:
        return model, None
    return repo, tag


def select_gguf_files(files: list[str], quant: str) -> list[str]:
    """The repo paths of quantization `quant` (case-insensitive, bounded by separators, so Q4_K does not pick
    Q4_K_M): one file, or every part of one split set in order. ValueError naming the quantizations there are."""
    tag = re.compile(rf"(?:^|[-._/]){re.escape(quant)}(?=$|[-./])", re.IGNORECASE)
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    chosen = [f for f in ggufs if tag.search(f[: -len(".gguf")]) and "mmproj" not in f.lower()]
    if not chosen:
        raise ValueError(f"no GGUF file of quantization {quant!r} in the repository (it has: "
                         f"{', '.join(available_quants(ggufs)) or 'no .gguf file'})")
    sets = {(_SPLIT_PART.sub("", f), int(m[2])) if (m := _SPLIT_PART.search(f)) else (f, 1) for f in chosen}
    if len(sets) > 1:
        raise ValueError(f"quantization {quant!r} names several GGUF models in the repository "
                         f"({', '.join(sorted(s for s, _ in sets))}); pass a longer tag or download the file")
    stem, total = sets.pop()
    if total == 1:
        return chosen
    parts = [f"{stem}-{i:05d}-of-{total:05d}.gguf" for i in range(1, total + 1)]
    missing = [p for p in parts if p not in ggufs]
    if missing:
        raise ValueError(f"split GGUF {stem} has {total} parts; the repository lacks {', '.join(missing)}")
    return parts


def available_quants(files: list[str]) -> list[str]:
    """The quantization tags of the repo's GGUF files (Q4_K_M, IQ4_XS, F16, ...), as a user would pass them."""
    names = (re.sub(r"\.gguf$", "", _SPLIT_PART.sub(".gguf", Path(f).name)) for f in files
             if f.endswith(".gguf") and "mmproj" not in f.lower())
    tags = {m[1].upper() for n in names if (m := re.search(r"[-._]((?:I?Q\d\w*?|[BF]F?\d+))$", n, re.IGNORECASE))}
    return sorted(tags)


def download_gguf(repo: str, quant: str, revision: str | None = None) -> Path:
    """-> the local path of the chosen file (the first part of a split set; its siblings lie beside it)."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
    try:
        files = HfApi().list_repo_files(repo, revision=revision)
    except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError):
        raise
    except Exception as exc:          # offline (HF_HUB_OFFLINE, no network): what the local hub cache holds
        logger.info("hub not reachable (%s); looking for %s:%s in the local hub cache", type(exc).__name__,
                    repo, quant)
        try:
            snapshot = Path(snapshot_download(repo, revision=revision, local_files_only=True))
        except Exception:            # not cached either: the hub's own error is the one to show
            raise RuntimeError(f"cannot list the files of {repo} on the hub ({type(exc).__name__}: {exc}), and the "
                               "local hub cache does not hold it") from exc
        files = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*.gguf")]
    chosen = select_gguf_files(files, quant)
    logger.info("GGUF %s:%s -> %s", repo, quant, ", ".join(chosen))
    return Path([hf_hub_download(repo, f, revision=revision) for f in chosen][0])


def gguf_only_repo(repo: str, revision: str | None = None) -> None:
    """A repository without config.json: ValueError telling how to pick one of its GGUF files, if it has any."""
    from huggingface_hub import HfApi
    try:
        files = HfApi().list_repo_files(repo, revision=revision)
    except Exception:                 # offline: the loader's own error (no config.json) follows
        return
    quants = available_quants(files)
    if quants:
        raise ValueError(f"{repo} is a GGUF repository: name one quantization, as in {repo}:{quants[0]} "
                         f"(it has: {', '.join(quants)})")
