"""Find a model (local directory or hub id), read its config, build the decoder and fill it from safetensors."""
import logging
from pathlib import Path

import torch
from tqdm import tqdm

from quant_serve.engine.load.checkpoint import (INDEX, check_finite, check_float_tensor, check_layer_count,
                                                check_raw_config, list_weight_files, open_weights, read_json_object,
                                                read_tensor_names)
from quant_serve.engine.config import HEAD_GROUP_SIZE, ModelConfig
from quant_serve.engine.load.gguf.hub import download_gguf, gguf_only_repo, split_quant_tag
from quant_serve.engine.load.hf_config import DTYPES, model_config_from_hf
from quant_serve.engine.worker.kv_scales import checkpoint_scale_value, parse_kv_scale_name
from quant_serve.engine.models.decoder import DecoderForCausalLM

logger = logging.getLogger("quant_serve")

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
CONFIG_PATTERNS = ["config.json", "*.safetensors.index.json", "quantize_config.json", "quant_config.json"]
# Published configs (no weights) of models our users serve, shipped so that `plan`, `kernels --explain` and dummy-
# weight benchmarks run with no download: `quant-serve plan qwen2.5-7b-instruct`.
BUNDLED_CONFIGS = Path(__file__).resolve().parent / "configs"


def bundled_config_names() -> list[str]:
    return sorted(p.parent.name for p in BUNDLED_CONFIGS.glob("*/config.json"))
_DTYPES = DTYPES


def resolve_model_dir(model: str, revision: str | None = None, config_only: bool = False) -> Path:
    """A local directory as is; then a bundled config's name; otherwise a Hugging Face hub id, downloaded (or found
    in the local hub cache). config_only: fetch only the config files of a hub model (plan, kernels --explain)."""
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists():
        raise ValueError(f"model path {model} is a file, expected a directory holding config.json and weights "
                         "(or a .gguf file)")
    if model in bundled_config_names():
        return BUNDLED_CONFIGS / model
    repo, quant = split_quant_tag(model)
    if model.startswith((".", "/", "~")) or repo.count("/") != 1:
        raise FileNotFoundError(f"model directory {model} does not exist (and it is not a hub id like org/name, "
                                "or org/name:Q4_K_M for one quantization of a GGUF repository, nor a bundled "
                                f"config: {', '.join(bundled_config_names())})")
    if quant is not None:
        return download_gguf(repo, quant, revision)
    from huggingface_hub import snapshot_download
    logger.info("downloading %s%s from the Hugging Face hub", "the config of " if config_only else "", model)
    path = Path(snapshot_download(model, revision=revision,
                                  allow_patterns=CONFIG_PATTERNS if config_only else HUB_PATTERNS))
    if not (path / "config.json").is_file():
        gguf_only_repo(model, revision)        # a GGUF repository: ValueError naming its quantizations
    return path


def load_model_config(model_dir: Path) -> tuple[ModelConfig, dict]:
    """Read config.json through transformers' AutoConfig (both rope_theta and rope_parameters styles); a GGUF
    checkpoint's config from its metadata (engine/load/gguf/loader.py)."""
    from quant_serve.engine.load.gguf.loader import gguf_files, gguf_model_config, open_gguf
    files = gguf_files(model_dir)
    if files is not None:
        cfg = gguf_model_config(open_gguf(files))
        return cfg, {"quantization_config": cfg.quantization_config}
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    raw = read_json_object(config_file)
    check_raw_config(raw, config_file)
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported architecture {archs or raw.get('model_type')!r} in {config_file}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    from transformers import AutoConfig
    try:
        hf = AutoConfig.from_pretrained(str(model_dir))
    except Exception as e:                  # transformers' errors for malformed values are of many types
        raise ValueError(f"cannot read {config_file} with transformers: {type(e).__name__}: {e}") from e
    return model_config_from_hf(hf, arch, raw, config_file, model_dir), raw


def build_model(cfg: ModelConfig, dtype: torch.dtype, device, quant_config) -> DecoderForCausalLM:
    with torch.device(device):
        return DecoderForCausalLM(cfg, dtype, device, quant_config)


def load_weights(model: DecoderForCausalLM, names: dict[str, Path],
                 show_progress: bool = True) -> dict[int, dict[str, float]]:
    """Copy every checkpoint tensor into the model; merged layers (qkv, gate_up) are filled shard by shard.
    Returns the FP8 KV-cache scales found: {layer: {"k_scale": x, "v_scale": y}} (engine/worker/kv_scales.py)."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    expected_shards = {(name, i) for name, m in modules.items() if hasattr(m, "load_shard")
                       for i in range(len(m.output_sizes))}
    loaded_params, loaded_shards = set(), set()
    by_file: dict[Path, list[str]] = {}
    for name, file in names.items():
        by_file.setdefault(file, []).append(name)
    source_tensors: dict[tuple[str, int], dict] = {}
    kv_scales: dict[int, dict[str, float]] = {}
    with tqdm(total=len(names), desc="Loading weights", unit="tensor", disable=not show_progress) as bar:
        for file, keys in by_file.items():
            with open_weights(file) as f:
                for key in keys:
                    bar.update(1)
                    if key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and model.lm_head is None):
                        continue
                    try:
                        tensor = f.get_tensor(key)
                    except Exception as e:
                        raise ValueError(f"cannot read tensor {key} from {file}: {e} (truncated file?)") from e
                    check_finite(key, file, tensor)
                    # Before the module routing: k_proj.k_scale would otherwise reach qkv_proj's shard loader.
                    kv_target = parse_kv_scale_name(key)
                    if kv_target is not None:
                        layer, which = kv_target
                        for w in which:
                            kv_scales.setdefault(layer, {})[f"{w}_scale"] = checkpoint_scale_value(key, tensor)
                        continue
                    module_name, suffix = key.rsplit(".", 1)
                    parent, _, leaf = module_name.rpartition(".")
                    if leaf in model.packed_modules:
                        merged, shard = model.packed_modules[leaf]
                        module_name = f"{parent}.{merged}"
                    else:
                        shard = 0
                    module = modules.get(module_name)
                    if module is not None and hasattr(module, "load_shard"):
                        source_tensors.setdefault((module_name, shard), {})[suffix] = tensor
                        continue
                    if key in params:
                        param = params[key]
                        check_float_tensor(key, file, tensor)
                        if tuple(param.shape) != tuple(tensor.shape):
                            raise ValueError(f"{key} in {file} has shape {tuple(tensor.shape)}, "
                                             f"expected {tuple(param.shape)}")
                        param.data.copy_(tensor)
                        loaded_params.add(key)
                    else:
                        logger.warning("ignoring unexpected tensor %s in %s", key, file)
            for (module_name, shard), tensors in list(source_tensors.items()):
                prefix = model.source_prefix(module_name, shard)
                try:
                    modules[module_name].load_shard(shard, tensors, prefix)
                except ValueError as e:
                    raise ValueError(f"{e} (in {file})") from e
                loaded_shards.add((module_name, shard))
            source_tensors.clear()
    for m in modules.values():
        if hasattr(m, "finalize"):
            m.finalize()
    missing = [f"{n} (shard {i})" for n, i in sorted(expected_shards - loaded_shards)]
    plain = {n for n, p in params.items() if not any(n.startswith(f"{m}.") for m, _ in expected_shards)}
    missing += sorted(plain - loaded_params)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {', '.join(missing[:5])}")
    return kv_scales


def init_dummy_weights(model: DecoderForCausalLM, seed: int = 0) -> None:
    """Random weights for speed work from a config alone (--load-format dummy). Never for accuracy."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)   # on the GPU: a 7B model initializes in seconds
    for module in model.modules():
        if hasattr(module, "init_dummy"):
            module.init_dummy(gen)
            continue
        for name, param in module.named_parameters(recurse=False):
            if name == "weight" and param.dim() == 1:
                param.data.fill_(1.0)       # norms
            elif param.dim() >= 1:
                param.data.normal_(0.0, 0.02, generator=gen)


def quantize_head(model: DecoderForCausalLM) -> None:
    """--quantize-lm-head: replace the FP16/BF16 head (or, tied, add one beside the embedding table, which token
    lookups keep reading) by an INT4 g128 round-to-nearest copy; a head the checkpoint quantized stays as it is.
    The head is the largest matrix a decode step reads: 1.09 GB of Qwen2.5-7B's 4.5 in FP16."""
    from quant_serve.quant.layers.linear import QuantLinear
    if isinstance(model.lm_head, QuantLinear):
        logger.info("--quantize-lm-head: the checkpoint's head is already INT4")
        return
    weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    vocab, hidden = weight.shape
    if vocab % 16 or hidden % HEAD_GROUP_SIZE:
        raise ValueError(f"--quantize-lm-head needs a vocabulary that is a multiple of 16 and a hidden size that is "
                         f"a multiple of {HEAD_GROUP_SIZE}; this head is [{vocab}, {hidden}]")
    head = QuantLinear.round_to_nearest(weight.detach(), HEAD_GROUP_SIZE, weight.dtype, weight.device)
    model.lm_head = head
    del weight
    if head.device.type == "cuda":
        torch.cuda.empty_cache()            # the FP16 head and the scratch go back before the KV cache is sized


def load_model(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, device, load_format: str = "auto",
               quantization: str | None = None, show_progress: bool = True, seed: int = 0, int4_head: bool = False):
    """-> (model, quant_config or None). quant_config describes the checkpoint's INT4 format. int4_head:
    quantize_head after loading."""
    model, quant_config = _load_model(model_dir, cfg, dtype, device, load_format, quantization, show_progress, seed)
    if int4_head:
        quantize_head(model)
    return model, quant_config


def _load_model(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, device, load_format: str,
                quantization: str | None, show_progress: bool, seed: int):
    from quant_serve.engine.load.gguf.loader import gguf_files, load_gguf_model, open_gguf
    from quant_serve.quant.formats import load_quant_config
    files = gguf_files(model_dir)
    if files is not None:
        if load_format not in ("auto", "gguf"):
            raise ValueError(f"{model_dir} is a GGUF checkpoint: --load-format {load_format} does not apply (use "
                             "auto, or dummy with a config.json directory and --quantization gguf:Q4_K_M)")
        if quantization not in (None, "gguf"):
            raise ValueError(f"--quantization {quantization} disagrees with the checkpoint, which is GGUF")
        return load_gguf_model(open_gguf(files), cfg, dtype, device, show_progress)
    if load_format == "dummy" and quantization and quantization.lower().startswith("gguf:"):
        from quant_serve.quant.formats.gguf.config import dummy_gguf_config
        quant_config = dummy_gguf_config(quantization.split(":", 1)[1], cfg.num_layers)
        model = build_model(cfg, dtype, device, quant_config)
        init_dummy_weights(model, seed)
        model.checkpoint_kv_scales = {}
        logger.info("dummy GGUF %s: linear layers %s", quantization,
                    quant_config.describe_paths())
        return model.eval(), quant_config
    if load_format == "dummy":
        raw = read_json_object(Path(model_dir) / "config.json")
        quant_config = load_quant_config(raw, model_dir, None, quantization)
        model = build_model(cfg, dtype, device, quant_config)
        init_dummy_weights(model, seed)
        model.checkpoint_kv_scales = {}
        return model.eval(), quant_config
    if load_format not in ("auto", "safetensors"):
        raise ValueError(f"unsupported load format {load_format!r} (supported: auto, safetensors, dummy)")
    files = list_weight_files(model_dir)
    names = read_tensor_names(files, Path(model_dir) / INDEX)
    check_layer_count(names, cfg.num_layers, Path(model_dir) / "config.json")
    raw = read_json_object(Path(model_dir) / "config.json")
    quant_config = load_quant_config(raw, model_dir, set(names), quantization)
    model = build_model(cfg, dtype, device, quant_config)
    # Handed to the KV cache setup (engine/worker/kv_scales.py resolve_kv_scales), which decides whether to use them.
    model.checkpoint_kv_scales = load_weights(model, names, show_progress)
    return model.eval(), quant_config


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(requested: str, cfg: ModelConfig, device: str, quantized: bool) -> torch.dtype:
    """auto: fp32 on the CPU path (exact and fast enough there); on CUDA the checkpoint dtype, fp16 for INT4, bf16
    for Gemma."""
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(f"unsupported dtype {requested!r} (supported: auto, float16, bfloat16, float32)")
        return _DTYPES[requested]
    if device == "cpu":
        return torch.float32
    if cfg.gemma_norm:             # Gemma's activations outgrow fp16 (vLLM refuses fp16 for Gemma 2/3)
        return torch.bfloat16
    if quantized:
        return torch.float16
    return cfg.torch_dtype if cfg.torch_dtype in (torch.float16, torch.bfloat16) else torch.float16


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    from quant_serve.engine.load.gguf.loader import gguf_files, gguf_tokenizer, open_gguf
    files = gguf_files(path)
    if files is not None:
        return gguf_tokenizer(open_gguf(files))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {path}: {e}") from e
    # without tokenizer files transformers may build an empty tokenizer, which turns every prompt into no tokens
    if not tokenizer.encode("hello world", add_special_tokens=False):
        raise ValueError(f"no usable tokenizer in {path} (tokenizer.json, tokenizer.model or vocab.json is "
                         "missing): add the tokenizer files or pass --tokenizer DIR")
    return tokenizer
