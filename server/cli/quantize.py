"""`quant-serve quantize MODEL_DIR OUT_DIR --method {rtn,awq,gptq}`: read the FP16 checkpoint through engine/
helpers, tokenize the calibration text, and hand plain tensors and the engine's decoder (as the model to calibrate
on, engine/models/dense_calib.py) to quant/quantize.py."""
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from quant_serve.engine.calib_samples import CPU_WINDOWS, GPU_WINDOWS, default_windows, sample_token_windows
from quant_serve.engine.load.checkpoint import INDEX, check_finite, list_weight_files, read_tensor_names
from quant_serve.engine.load.loader import load_model_config
from quant_serve.engine.models.dense_calib import DenseCalibModel
from quant_serve.quant.awq import CPU_SEARCH_TOKENS, AWQSettings, default_search_tokens
from quant_serve.quant.calib import EOT, calib_tokens, read_calib_file
from quant_serve.quant.gptq import GPTQSettings
from quant_serve.quant.output import check_output_dir
from quant_serve.quant.quantize import FORMATS, METHODS, QuantizeConfig, SourceModel, quantize_model

logger = logging.getLogger("quant_serve")

COPY_PATTERNS = ["tokenizer*", "special_tokens_map.json", "vocab.json", "vocab.txt", "merges.txt",
                 "added_tokens.json", "*.jinja", "chat_template.json", "generation_config.json"]
CALIB_HELP = ("plain text (documents separated by blank lines or <|endoftext|>) or JSONL with a \"text\" field, "
              "e.g. from `quant-serve make-calib calib.jsonl`; default: --calib-samples sequences of --calib-seq-len "
              "tokens sampled from the model itself (temperature 1, --calib-seed); quant-serve never downloads "
              "calibration data")
FILE_WINDOWS = (128, 512)           # windows cut from a --calib file when --calib-samples / --calib-seq-len are unset


def register(subparsers) -> None:
    p = subparsers.add_parser("quantize", help="quantize a model's linear layers to INT4 (RTN, AWQ or GPTQ) and "
                                               "write a standard AWQ / GPTQ / compressed-tensors checkpoint")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="unquantized checkpoint (config.json + safetensors)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="where to write the quantized checkpoint")
    p.add_argument("--method", choices=METHODS, default="awq")
    p.add_argument("--group-size", type=int, default=128, help="input channels per scale (-1: one group)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=None,
                     help="symmetric, z = 8 (default for gptq)")
    sym.add_argument("--asym", dest="sym", action="store_false", help="zero point per group (default for rtn, awq)")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="checkpoint format (default: awq for asym rtn/awq, gptq for sym, gptq_v2 for asym gptq)")
    p.add_argument("--calib", default=None, metavar="FILE", help="calibration text (awq, gptq): " + CALIB_HELP)
    p.add_argument("--calib-samples", type=int, default=None,
                   help=f"calibration windows (default: {FILE_WINDOWS[0]} from --calib; sampled from the model: "
                        f"{GPU_WINDOWS.count} on CUDA, {CPU_WINDOWS.count} on the CPU)")
    p.add_argument("--calib-seq-len", type=int, default=None,
                   help=f"tokens per calibration window (default: {FILE_WINDOWS[1]} from --calib; sampled from the "
                        f"model: {GPU_WINDOWS.length} on CUDA, {CPU_WINDOWS.length} on the CPU)")
    p.add_argument("--calib-seed", type=int, default=0, help="seed of the calibration text sampled from the model "
                                                             "(without --calib)")
    p.add_argument("--awq-search-tokens", type=int, default=None,
                   help="awq: calibration tokens (whole windows) each candidate scale is scored on through the "
                        f"attention and the MLP (default: {AWQSettings.search_tokens} on CUDA, {CPU_SEARCH_TOKENS} "
                        "on the CPU)")
    p.add_argument("--act-order", action="store_true", help="gptq: quantize columns by descending Hessian diagonal")
    p.add_argument("--static-groups", action="store_true",
                   help="gptq --act-order: keep groups in the original order (g_idx = k // G; vLLM-friendly)")
    p.add_argument("--damp-percent", type=float, default=0.01, help="gptq: damping, fraction of mean diag(H)")
    p.add_argument("--device", default="auto", help="compute device: auto (cuda if available), cuda, cpu, cuda:1")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it holds a checkpoint quant-serve wrote (and nothing else)")
    p.add_argument("--lm-head", action="store_true",
                   help="also quantize the output head (GPTQ on the last hidden states with --method gptq, else "
                        "round-to-nearest; gptq, gptq_v2 and compressed-tensors formats; untied heads only): a "
                        "quarter of the bytes a decode step reads for it")
    p.add_argument("--kv-scales", action="store_true",
                   help="also calibrate per-layer FP8 KV-cache scales on the calibration text and store them as "
                        "kv_scales.json next to the weights (read by --kv-cache-dtype fp8)")
    p.set_defaults(func=cmd_quantize)


def cmd_quantize(args) -> int:
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    search_tokens = default_search_tokens(device) if args.awq_search_tokens is None else args.awq_search_tokens
    cfg = QuantizeConfig(method=args.method, group_size=args.group_size, sym=args.sym, format=args.format,
                         device=device, awq=AWQSettings(search_tokens=search_tokens), lm_head=args.lm_head,
                         gptq=GPTQSettings(damp_percent=args.damp_percent, act_order=args.act_order,
                                           static_groups=args.static_groups))
    sym, fmt = cfg.resolved()
    if (args.act_order or args.static_groups) and args.method != "gptq":
        raise ValueError("--act-order and --static-groups apply to --method gptq only")
    model_dir = Path(args.model_dir)
    source = load_source(model_dir)
    check_output_dir(args.out_dir, model_dir, args.overwrite)      # before sampling calibration text
    calib = None
    if args.method != "rtn" or args.kv_scales:
        if args.calib is None:
            default = default_windows(device)
            count = default.count if args.calib_samples is None else args.calib_samples
            length = default.length if args.calib_seq_len is None else args.calib_seq_len
            logger.info("calibration: %d sequences x %d tokens sampled from the model (seed %d); pass --calib FILE "
                        "for your own data", count, length, args.calib_seed)
            calib, _ = sample_token_windows(model_dir, count, length, args.calib_seed, device)
        else:
            calib = tokenize_calib(model_dir, args.calib,
                                   FILE_WINDOWS[0] if args.calib_samples is None else args.calib_samples,
                                   FILE_WINDOWS[1] if args.calib_seq_len is None else args.calib_seq_len)
            logger.info("calibration: %d windows of %d tokens from %s", calib.shape[0], calib.shape[1], args.calib)
    logger.info("quantizing %s with %s (%s, group %d) on %s into %s format", model_dir, args.method,
                "sym" if sym else "asym", args.group_size, device, fmt)
    kv_scales = (lambda tmp: write_calibrated_kv_scales(tmp, calib, device)) if args.kv_scales else None
    quantize_model(source, calib, cfg, args.out_dir, overwrite=args.overwrite, finish=kv_scales)
    print(f"wrote {args.out_dir} ({fmt}); run it with: quant-serve generate --model {args.out_dir} --prompt ...")
    return 0


def write_calibrated_kv_scales(out_dir: Path, calib: torch.Tensor, device: str) -> None:
    """K/V amax of the quantized model on the calibration windows -> out_dir/kv_scales.json (out_dir: the
    finished checkpoint before it is moved into place)."""
    from quant_serve.engine.config import CacheConfig, EngineConfig
    from quant_serve.engine.worker.kv_calibration import calibrate_kv_scales
    from quant_serve.engine.worker.kv_scales import write_kv_scales
    from quant_serve.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=str(out_dir), device=device, enforce_eager=True,
                                    max_model_len=calib.shape[1] + 1, cache=CacheConfig(kv_cache_memory_gb=0.25)),
                       show_progress=False)
    path = write_kv_scales(out_dir, calibrate_kv_scales(engine, calib.tolist()))
    logger.info("calibrated FP8 KV scales for %d layers (%s)", engine.model_config.num_layers, path.name)


def load_source(model_dir: Path) -> SourceModel:
    """The checkpoint, read lazily, with the engine's decoder as the forward AWQ and GPTQ calibrate on."""
    cfg, raw = load_model_config(model_dir)
    names = read_tensor_names(list_weight_files(model_dir), Path(model_dir) / INDEX)

    def read(name: str) -> torch.Tensor:
        with safe_open(str(names[name]), framework="pt") as f:
            tensor = f.get_tensor(name)
        check_finite(name, names[name], tensor)              # NaN in, NaN scales out
        return tensor

    extra = sorted({p for pattern in COPY_PATTERNS for p in Path(model_dir).glob(pattern) if p.is_file()})
    return SourceModel(cfg.num_layers, raw, list(names), read, extra, Path(model_dir), DenseCalibModel(cfg, read))


def tokenize_calib(model_dir: Path, path: str, samples: int, seq_len: int) -> torch.Tensor:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    docs = read_calib_file(path)
    if EOT in tok.get_vocab():
        separator = tok.encode(f"\n{EOT}\n", add_special_tokens=False)
    else:
        separator = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return calib_tokens(docs, lambda text: tok.encode(text, add_special_tokens=False), samples, seq_len, separator)
