"""GGUF checkpoints (llama.cpp, Ollama, LM Studio): a .gguf file, a directory holding one, or split files
`NAME-00001-of-0000N.gguf`. The file is read with engine/gguf_file.py (tensors memory-mapped) and its tensors
converted to the internal layouts without re-quantizing (quant/formats/gguf_types.py); config, tokenizer and chat
template come from the GGUF metadata through transformers' GGUF support (engine/gguf_cache.py keeps them)."""
import functools
import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from quant_serve.engine.checkpoint import check_size
from quant_serve.engine.config import ModelConfig
from quant_serve.engine.gguf_cache import DEFAULT_ROOT, cached

logger = logging.getLogger("quant_serve")

# GGUF general.architecture -> the transformers class our decoder implements
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<total>\d{5})\.gguf$")


@dataclass
class GGUFCheckpoint:
    files: list[Path]
    arch: str                                   # GGUF general.architecture
    tensors: dict                               # GGUF tensor name -> gguf.ReaderTensor (engine/gguf_file.py)
    metadata: dict                              # GGUF key -> value (engine/gguf_hparams.py; no vocabulary)
    end_of_generation: list[int] = field(default_factory=list)   # stop ids beside eos (end_of_generation_ids)

    @property
    def first(self) -> Path:
        return self.files[0]

    def type_mix(self) -> dict[str, int]:
        """GGUF type name -> number of 2-D tensors (the matrices; norms and biases are F32 in every file)."""
        mix: dict[str, int] = {}
        for t in self.tensors.values():
            if len(t.shape) == 2:
                mix[t.tensor_type.name] = mix.get(t.tensor_type.name, 0) + 1
        return mix


def gguf_files(model: str | Path) -> list[Path] | None:
    """The GGUF files `model` names (a .gguf file, the first or any part of a split set, or a directory with no
    config.json holding one model's .gguf files), or None when it is not a GGUF checkpoint."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        m = _SPLIT.match(path.name)
        return _split_set(path.parent, m["stem"], int(m["total"])) if m else [path]
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if not found:
        return None
    splits = {(m["stem"], int(m["total"])) for f in found if (m := _SPLIT.match(f.name))}
    singles = [f for f in found if not _SPLIT.match(f.name)]
    if len(splits) + len(singles) > 1:
        names = ", ".join(f.name for f in found)
        raise ValueError(f"{path} holds more than one GGUF model ({names}); pass the file to load")
    if singles:
        return singles
    stem, total = splits.pop()
    return _split_set(path, stem, total)


def _split_set(folder: Path, stem: str, total: int) -> list[Path]:
    files = [folder / f"{stem}-{i:05d}-of-{total:05d}.gguf" for i in range(1, total + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"split GGUF {stem} has {total} parts, missing: {', '.join(missing)}")
    return files


def open_gguf(files: list[Path]) -> GGUFCheckpoint:
    """The checkpoint of `files`; read once per file version although config, tokenizer and weights each ask for
    it."""
    key = tuple((str(Path(f).resolve()), Path(f).stat().st_mtime_ns, Path(f).stat().st_size) for f in files)
    return _open_gguf(key)


@functools.lru_cache(maxsize=2)
def _open_gguf(key: tuple) -> GGUFCheckpoint:
    from quant_serve.engine.gguf_file import read_gguf
    from quant_serve.engine.gguf_hparams import end_of_generation_ids, metadata
    files = [Path(path) for path, _, _ in key]
    tensors, arch, meta, stops = {}, None, {}, None
    for file in files:
        reader = read_gguf(file)                          # ValueError naming what is damaged
        meta = meta or metadata(reader)                   # split parts after the first hold no hyper-parameters
        stops = end_of_generation_ids(reader) if stops is None else stops
        arch = arch or meta.get("general.architecture")
        for t in reader.tensors:
            if t.name in tensors:
                raise ValueError(f"tensor {t.name} is in two parts of {files[0].name}")
            tensors[t.name] = t
    if arch is None:
        raise ValueError(f"{files[0]} has no general.architecture: not a model GGUF")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {files[0]}; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    return GGUFCheckpoint(list(files), arch, tensors, meta, stops)


def gguf_hf_config(ckpt: GGUFCheckpoint, cache_root: Path = DEFAULT_ROOT):
    """transformers' config of the GGUF (cached: engine/gguf_cache.py), completed from the metadata it does not
    map (engine/gguf_hparams.py)."""
    from transformers import AutoConfig

    from quant_serve.engine.gguf_hparams import apply_gguf_hparams

    def build():
        try:
            return AutoConfig.from_pretrained(str(ckpt.first.parent), gguf_file=ckpt.first.name)
        except Exception as e:
            raise ValueError(f"cannot read the config of {ckpt.first} with transformers: {type(e).__name__}: "
                             f"{e}") from e
    hf = cached(ckpt.first, "config", build, lambda hf, d: hf.save_pretrained(d),
                lambda d: AutoConfig.from_pretrained(str(d)), cache_root)
    for field, key in (("hidden_size", "embedding_length"), ("num_attention_heads", "attention.head_count")):
        check_size(f"{ckpt.arch}.{key}", getattr(hf, field, None), ckpt.first)   # apply_gguf_hparams divides
    apply_gguf_hparams(hf, ckpt.arch, ckpt.metadata, ckpt.tensors)
    return hf


def gguf_model_config(ckpt: GGUFCheckpoint) -> ModelConfig:
    from quant_serve.engine.hf_config import model_config_from_hf
    hf = gguf_hf_config(ckpt)
    cfg = model_config_from_hf(hf, GGUF_ARCHITECTURES[ckpt.arch], {}, ckpt.first, None)
    # quantized GGUF weights run as fp16 on CUDA (pick_dtype, quantized): the file's own float type says nothing
    eos = tuple(dict.fromkeys([*cfg.eos_token_ids, *ckpt.end_of_generation]))
    return replace(cfg, tie_word_embeddings="output.weight" not in ckpt.tensors, torch_dtype=torch.float16,
                   eos_token_ids=eos,
                   quantization_config={"quant_method": "gguf", "types": ckpt.type_mix()})


def gguf_tokenizer(ckpt: GGUFCheckpoint, cache_root: Path = DEFAULT_ROOT):
    """The tokenizer of the GGUF's vocabulary (cached: engine/gguf_cache.py)."""
    from transformers import AutoTokenizer

    def build():
        try:
            return AutoTokenizer.from_pretrained(str(ckpt.first.parent), gguf_file=ckpt.first.name)
        except Exception as e:
            raise ValueError(f"cannot build a tokenizer from {ckpt.first}: {type(e).__name__}: {e} (pass "
                             "--tokenizer DIR with the original model's tokenizer files)") from e
    return cached(ckpt.first, "tokenizer", build, lambda tok, d: tok.save_pretrained(d),
                  lambda d: AutoTokenizer.from_pretrained(str(d)), cache_root)


def _name_map(ckpt: GGUFCheckpoint, num_layers: int):
    import gguf
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[ckpt.arch]
    return gguf.get_tensor_name_map(arch, num_layers)


def gguf_quant_config(ckpt: GGUFCheckpoint, cfg: ModelConfig):
    """The GGUFConfig that picks each linear layer's path from its tensors' types."""
    from quant_serve.quant.formats.gguf_config import GGUFConfig
    name_map = _name_map(ckpt, cfg.num_layers)

    def type_of(prefix: str):
        return ckpt.tensors[_gguf_name(name_map, prefix, "weight", ckpt)].tensor_type

    names = frozenset(p for p in ("lm_head.weight",) if "output.weight" in ckpt.tensors)
    return GGUFConfig("gguf", 4, 32, str(ckpt.first), names, type_of=type_of, type_mix=ckpt.type_mix())


def _gguf_name(name_map, hf_prefix: str, suffix: str, ckpt: GGUFCheckpoint, required: bool = True) -> str | None:
    base = name_map.get_name(hf_prefix)
    name = f"{base}.{suffix}" if base else None
    if name is None or name not in ckpt.tensors:
        if required:
            raise ValueError(f"{ckpt.first} has no tensor for {hf_prefix}.{suffix} "
                             f"(looked for {name or 'a GGUF name'}; the file is incomplete or of another model)")
        return None
    return name


def _unpermute_rows(n: int, n_head: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's q / k rows from rotate-half to interleaved pairs (row h*D + 2j + i
    holds h*D + i*D/2 + j); this index gathers the original order back: orig = stored[index]."""
    d = n // n_head
    return torch.arange(n).view(n_head, d // 2, 2).transpose(1, 2).reshape(-1)


def load_gguf_weights(model, ckpt: GGUFCheckpoint, cfg: ModelConfig, show_progress: bool = True) -> None:
    from quant_serve.engine.checkpoint import check_finite
    from quant_serve.quant.formats.gguf_types import read_dense, read_grouped
    from quant_serve.quant.linear_dense import DenseLinear
    name_map = _name_map(ckpt, cfg.num_layers)
    modules = dict(model.named_modules())
    linears = {n: m for n, m in modules.items()
               if hasattr(m, "load_shard") and not getattr(m, "routed_by_parent", False)}   # parts load via theirs
    used = set()
    for mod_name, module in tqdm(linears.items(), desc="Loading GGUF", unit="layer", disable=not show_progress):
        for shard, n in enumerate(module.output_sizes):
            prefix = model.source_prefix(mod_name, shard)
            name = _gguf_name(name_map, prefix, "weight", ckpt)
            t = ckpt.tensors[name]
            k = module.in_features
            if tuple(int(x) for x in t.shape) != (k, n):
                raise ValueError(f"{name} in {ckpt.first} has shape {tuple(int(x) for x in t.shape)} (ggml order "
                                 f"[in, out]), expected {(k, n)} for {prefix}")
            rows = _row_order(ckpt.arch, prefix, n, cfg)
            bias_name = _gguf_name(name_map, prefix, "bias", ckpt, required=False)
            tensors = {}
            if bias_name is not None:
                used.add(bias_name)
                tensors["bias"] = _rows(read_dense(ckpt.tensors[bias_name].data, ckpt.tensors[bias_name].tensor_type,
                                                   (n,)), rows)
            if isinstance(module, DenseLinear):
                tensors["weight"] = _rows(read_dense(t.data, t.tensor_type, (n, k)), rows)
                check_finite(name, ckpt.first, tensors["weight"])
            else:
                g = read_grouped(t.data, t.tensor_type, n, k, module.device)   # unpacked where it will live
                check_finite(f"{name} scales", ckpt.first, g.scales)
                if g.offsets is not None:
                    check_finite(f"{name} offsets", ckpt.first, g.offsets)
                if rows is not None:
                    g = g.rows(rows)
                tensors["codes"] = g
            module.load_shard(shard, tensors, prefix)
            used.add(name)
    for m in linears.values():
        if hasattr(m, "finalize"):
            m.finalize()
    for pname, param in model.named_parameters():
        if any(pname.startswith(f"{lin}.") for lin in linears):
            continue
        prefix, suffix = pname.rsplit(".", 1)
        name = _gguf_name(name_map, prefix, suffix, ckpt)
        t = ckpt.tensors[name]
        value = read_dense(t.data, t.tensor_type, tuple(param.shape))
        check_finite(name, ckpt.first, value)
        if cfg.gemma_norm and prefix.endswith("norm"):
            value = value.float() - 1.0               # llama.cpp stores Gemma's norms as 1 + w
        param.data.copy_(value)
        used.add(name)
    ignored = sorted(set(ckpt.tensors) - used)
    if ignored:
        logger.info("GGUF tensors not used by the model: %s", ", ".join(ignored[:8]))


def _row_order(arch: str, prefix: str, n: int, cfg: ModelConfig) -> torch.Tensor | None:
    if arch != "llama":
        return None
    if prefix.endswith("q_proj"):
        return _unpermute_rows(n, cfg.num_heads)
    if prefix.endswith("k_proj"):
        return _unpermute_rows(n, cfg.num_kv_heads)
    return None


def _rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t[rows]


def load_gguf_model(ckpt: GGUFCheckpoint, cfg: ModelConfig, dtype: torch.dtype, device,
                    show_progress: bool = True):
    """-> (model, GGUFConfig). Logs how many linear layers took which path."""
    from quant_serve.engine.models.decoder import DecoderForCausalLM
    quant_config = gguf_quant_config(ckpt, cfg)
    with torch.device(device):
        model = DecoderForCausalLM(cfg, dtype, device, quant_config)
    load_gguf_weights(model, ckpt, cfg, show_progress)
    model.checkpoint_kv_scales = {}
    logger.info("GGUF %s (%s): linear layers %s", ckpt.first.name, quant_config.describe(),
                quant_config.describe_paths())
    return model.eval(), quant_config
