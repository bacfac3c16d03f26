"""`quant-serve eval` without the CLI: the reference and each candidate through LLMEngine on the same windows."""
import gc
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quant_serve.engine.config import HEAD_GROUP_SIZE, CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from quant_serve.engine.llm_engine import LLMEngine
from quant_serve.kernels.gpu import KernelOptions
from quant_serve.eval.compare import ReferenceStore, TokenStats
from quant_serve.eval.data import load_tokens, make_windows
from quant_serve.eval.layer_error import LayerError, layer_errors
from quant_serve.eval.metadata import model_hash
from quant_serve.eval.tasks import DEFAULT_TASKS, TaskResult, load_task, run_task

logger = logging.getLogger("quant_serve")

MIN_MODEL_LEN = 1024      # room for task prompts and generations, whatever the window length
TASK_BATCH = 64           # sequences the scheduler runs at once for tasks


@dataclass
class EvalConfig:
    reference: str
    models: list[str] = field(default_factory=list)
    data: list[str] = field(default_factory=list)
    kv_cache_dtype: str | list[str] | None = None   # also evaluate the reference's weights with these KV caches
    kv_scale_source: str | None = None       # engine default when None
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    task_limit: int | None = None            # first N items of each task
    max_tokens: int | None = 32768
    context_len: int = 512
    stride: int = 512
    layer_windows: int = 4                   # windows of calibration activations for the per-layer error
    device: str = "auto"
    dtype: str = "auto"
    work_dir: str | None = None              # where the reference log-probs are spilled (default: the temp dir)
    quantize_lm_head: bool = False           # each --model also with the engine's --quantize-lm-head
    # activation paths each candidate runs (one candidate per path): auto / fp16 / int8, int8 and auto at each of
    # act_scales; without --model, the non-fp16 paths run on the reference's own weights (against its fp16 path)
    activation_dtypes: list[str] = field(default_factory=lambda: ["auto"])
    act_scales: list[str] = field(default_factory=lambda: ["group"])
    # a PEFT LoRA adapter every model runs under (the reference too): base + adapter against FP16 base + adapter
    lora: str | None = None


@dataclass
class Candidate:
    name: str
    model_dir: str
    kv_cache_dtype: str = "auto"
    kv_only: bool = False                    # same weights as the reference, only the KV cache dtype differs
    int4_head: bool = False                  # loaded with --quantize-lm-head
    activation_dtype: str = "auto"
    act_scale: str = "group"
    act_only: bool = False                   # same weights as the reference, only the activation path differs


@dataclass
class ModelResult:
    name: str
    model_dir: str
    kv_cache_dtype: str
    kv_only: bool
    format: str
    hash: str
    dtype: str
    stats: TokenStats
    tasks: dict[str, TaskResult] = field(default_factory=dict)
    layers: list[LayerError] = field(default_factory=list)
    kv_scales: dict | None = None
    activations: dict | None = None          # quant.activations.ActivationPlan.to_json(): the path each layer ran
    act_only: bool = False


@dataclass
class EvalResult:
    config: EvalConfig
    reference: ModelResult
    candidates: list[ModelResult]
    num_windows: int
    num_tokens: int
    device: str


KV_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8_e4m3",
            torch.float8_e5m2: "fp8_e5m2", torch.int8: "int8", torch.uint8: "int4"}   # integer caches: codes dtype


def kv_name(runner) -> str:
    """The cache a run used, as the report states it (an integer cache with its grouping, rotation and exact window:
    chosen by measured accuracy, docs/performance.md)."""
    return KV_NAMES[runner.kv_dtype] if runner.kv_format is None else runner.kv_description


def kv_cache_dtypes(cfg: EvalConfig) -> list[str]:
    """The KV cache candidates asked for (one name or several), in order, without repeats or "auto"."""
    kv = cfg.kv_cache_dtype
    names = [kv] if isinstance(kv, str) else list(kv or [])
    return [name for name in dict.fromkeys(names) if name != "auto"]


def kv_label(kv_cache_dtype: str) -> str:
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype


def activation_paths(cfg: EvalConfig) -> list[tuple[str, str]]:
    """(activation dtype, act scale) pairs in the order asked: fp16 once, auto and int8 at each scale."""
    paths = []
    for dtype in dict.fromkeys(cfg.activation_dtypes):
        for scale in ([cfg.act_scales[0]] if dtype == "fp16" else dict.fromkeys(cfg.act_scales)):
            paths.append((dtype, scale))
    return paths


def path_label(dtype: str, scale: str) -> str:
    return "fp16" if dtype == "fp16" else f"{dtype}/{scale}"


def plan_candidates(cfg: EvalConfig) -> list[Candidate]:
    names: dict[str, int] = {}
    out = []
    paths = activation_paths(cfg)
    for model in cfg.models:
        base = Path(model).name or model
        names[base] = names.get(base, 0) + 1
        name = base if names[base] == 1 else f"{base}#{names[base]}"
        for dtype, scale in paths:
            label = name if len(paths) == 1 else f"{name} a={path_label(dtype, scale)}"
            out.append(Candidate(label, model, activation_dtype=dtype, act_scale=scale))
        if cfg.quantize_lm_head:             # the head's own cost: the same weights with and without it
            out.append(Candidate(f"{name} +int4 head", model, int4_head=True))
    if not cfg.models:                       # the reference's own weights: int8 against its fp16 activations
        for dtype, scale in paths:
            if dtype != "fp16" and cfg.activation_dtypes != ["auto"]:
                out.append(Candidate(f"{Path(cfg.reference).name} a={path_label(dtype, scale)}", cfg.reference,
                                     activation_dtype=dtype, act_scale=scale, act_only=True))
    for kv in kv_cache_dtypes(cfg):
        out.append(Candidate(f"{Path(cfg.reference).name} kv={kv_label(kv)}", cfg.reference, kv, kv_only=True,
                             activation_dtype="fp16"))
    if not out:
        raise ValueError("nothing to compare: give at least one --model, --kv-cache-dtype fp8 or "
                         "--activation-dtype int8")
    return out


def make_engine(model: str, cfg: EvalConfig, kv_cache_dtype: str = "auto", int4_head: bool = False,
                activation_dtype: str = "fp16", act_scale: str = "group") -> LLMEngine:
    """An engine for one model of the comparison; the reference runs fp16 activations."""
    max_len = max(cfg.context_len, MIN_MODEL_LEN)
    cache = CacheConfig(num_gpu_blocks=max(4 * math.ceil(max_len / 16), 512), kv_cache_dtype=kv_cache_dtype,
                        enable_prefix_caching=False)   # prefix hits would skip prompt logprobs
    if cfg.kv_scale_source is not None:
        cache.kv_scale_source = cfg.kv_scale_source
    config = EngineConfig(model=model, dtype=cfg.dtype, device=cfg.device, cache=cache, quantize_lm_head=int4_head,
                          kernels=KernelOptions(activation_dtype=activation_dtype, act_scale=act_scale),
                          scheduler=SchedulerConfig(max_num_seqs=TASK_BATCH, max_model_len=max_len,
                                                    max_num_batched_tokens=max(2048, cfg.context_len)))
    if cfg.lora:
        config.lora = LoRAConfig(enable_lora=True, max_loras=1, max_lora_rank=adapter_rank(cfg.lora),
                                 lora_modules={lora_name(cfg): cfg.lora})
    engine = LLMEngine(config, show_progress=True)
    if engine.max_model_len < cfg.context_len:
        raise ValueError(f"{model}: context length {cfg.context_len} exceeds the model's maximum of "
                         f"{engine.max_model_len} tokens")
    return engine


def lora_name(cfg: EvalConfig) -> str | None:
    """The name the eval's engines serve --lora under (its folder's name), None without one."""
    return Path(cfg.lora).name if cfg.lora else None


def adapter_rank(path: str) -> int:
    """The largest rank of a PEFT adapter (r, and rank_pattern's), the slots' --max-lora-rank."""
    config_file = Path(path) / "adapter_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"--lora {path}: no adapter_config.json (a PEFT LoRA adapter directory)")
    config = json.loads(config_file.read_text())
    return max([int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())])


def describe(engine: LLMEngine) -> str:
    body = engine.quant_config.describe() if engine.quant_config else "unquantized"
    return body + (f" + INT4 g{HEAD_GROUP_SIZE} head (round-to-nearest at load)" if engine.config.quantize_lm_head
                   else "")


def dtype_name(engine: LLMEngine) -> str:
    return str(engine.dtype).replace("torch.", "")


def kv_scales(engine: LLMEngine) -> dict | None:
    if engine.runner.kv_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return None
    k = [float(a.k_scale) for a in engine.model.attention_layers]
    v = [float(a.v_scale) for a in engine.model.attention_layers]
    return {"k_scale": k, "v_scale": v, "source": getattr(engine.config.cache, "kv_scale_source", "unit")}


def check_same_tokenizer(reference: LLMEngine, candidate: LLMEngine, name: str) -> None:
    if reference.tokenizer.get_vocab() != candidate.tokenizer.get_vocab():
        raise ValueError(f"{name}: its tokenizer differs from the reference's; perplexity and KL divergence "
                         "need the same token stream")


def run_tasks(engine: LLMEngine, tasks, desc: str, lora: str | None = None) -> dict[str, TaskResult]:
    return {task.name: run_task(engine, task, desc, lora) for task in tasks}


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_eval(cfg: EvalConfig) -> EvalResult:
    candidates = plan_candidates(cfg)
    for path in cfg.data:       # fail before any model loads
        if not Path(path).is_file():
            raise FileNotFoundError(f"--data file {path} does not exist")
    if not cfg.data:
        raise ValueError("no evaluation text: pass --data FILE (plain UTF-8 text, e.g. a held-out split)")
    tasks = [load_task(spec, cfg.task_limit) for spec in cfg.tasks]
    ref_name = Path(cfg.reference).name
    logger.info("eval: reference %s, candidates %s", ref_name, ", ".join(c.name for c in candidates))
    reference = make_engine(cfg.reference, cfg)
    adapter = lora_name(cfg)
    if adapter:
        logger.info("eval: every model runs under the LoRA adapter %s (%s); no per-layer errors", adapter, cfg.lora)
    ids = load_tokens(cfg.data, reference.tokenizer, cfg.max_tokens)
    windows = make_windows(ids, cfg.context_len, cfg.stride)
    num_scored = sum(w.num_scored for w in windows)
    logger.info("eval: %d tokens, %d windows of %d (stride %d), %d scored", len(ids), len(windows),
                cfg.context_len, cfg.stride, num_scored)
    with ReferenceStore(windows, reference.model_config.vocab_size, cfg.work_dir) as store:
        logger.info("reference log-probs: %.2f GiB on disk", store.num_bytes / 2**30)
        ref_stats = store.fill(reference, ref_name, adapter)
        ref_result = ModelResult(ref_name, cfg.reference, kv_name(reference.runner), False,
                                 describe(reference), model_hash(reference.model_dir), dtype_name(reference),
                                 ref_stats, run_tasks(reference, tasks, ref_name, adapter),
                                 activations=reference.activations.to_json())
        results = []
        for cand in candidates:
            engine = make_engine(cand.model_dir, cfg, cand.kv_cache_dtype, cand.int4_head, cand.activation_dtype,
                                 cand.act_scale)
            check_same_tokenizer(reference, engine, cand.name)
            result = ModelResult(cand.name, cand.model_dir, kv_name(engine.runner), cand.kv_only,
                                 describe(engine), model_hash(engine.model_dir), dtype_name(engine),
                                 store.compare(engine, cand.name, adapter), activations=engine.activations.to_json(),
                                 act_only=cand.act_only)
            result.kv_scales = kv_scales(engine)     # after the first forward: first-prompt scales are set by then
            result.tasks = run_tasks(engine, tasks, cand.name, adapter)
            # the per-layer error is the base layers' (hooks on the unwrapped layers): not with an adapter
            result.layers = [] if adapter else layer_errors(reference, engine, windows[:cfg.layer_windows], cand.name)
            results.append(result)
            del engine          # one candidate in memory at a time, beside the reference
            _free_memory()
    return EvalResult(cfg, ref_result, results, len(windows), num_scored, str(reference.device))
