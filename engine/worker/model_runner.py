"""Turns a SchedulerOutput into flat batch tensors, runs the model over the paged KV cache and samples.
Owns every device tensor, including the KV cache (allocated once). Warm-up at start: engine/worker/warmup.py."""
import torch

from quant_serve.engine.worker.eager_inputs import eager_inputs
from quant_serve.engine.config import CacheConfig, ModelConfig
from quant_serve.engine.worker.cuda_graph import DecodeGraphs
from quant_serve.engine.worker.kv_scales import FP8_DTYPES, KVRangeObserver
from quant_serve.engine.models.decoder import DecoderForCausalLM
from quant_serve.engine.sample.sampler import PendingSample, Sampler, compute_prompt_logprobs, only_argmax
from quant_serve.engine.core.scheduler import SchedulerOutput
from quant_serve.engine.core.sequence import Logprob
from quant_serve.engine.spec.graphs import VerifyGraphs, VerifyRowGraphs
from quant_serve.engine.worker.steps import Carry, ForwardStep, LaunchedStep, PreparedForward, PreparedStep
from quant_serve.engine.worker.swap import CpuKVTier
from quant_serve.engine.worker.transfer import to_device
from quant_serve.kernels.gpu import options_for
from quant_serve.kernels.attention.kv_int import int_kv_exact_tokens, int_kv_format
from quant_serve.engine.worker.kv_exact_rows import ExactRowTable
from quant_serve.engine.worker.kv_pool import allocate_kv_cache

KV_CACHE_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16,
                   "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2, "float32": torch.float32}


INT_KV_CODES = {"int8": torch.int8, "int4": torch.uint8}      # integer caches: their codes' dtype


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in INT_KV_CODES:
        return INT_KV_CODES[kv_cache_dtype]
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unsupported kv cache dtype {kv_cache_dtype!r} "
                         f"(supported: auto, {', '.join([*KV_CACHE_DTYPES, *INT_KV_CODES])})")
    return KV_CACHE_DTYPES[kv_cache_dtype]


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, model_config: ModelConfig, cache_config: CacheConfig,
                 num_blocks: int, device: torch.device, dtype: torch.dtype, seed: int = 0, num_cpu_blocks: int = 0,
                 max_num_seqs: int = 256):
        self.model = model
        self.model_config = model_config
        self.block_size = cache_config.block_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_blocks = num_blocks
        self.kv_dtype = kv_cache_torch_dtype(cache_config.kv_cache_dtype, dtype)
        self.kv_format = int_kv_format(cache_config.kv_cache_dtype, model_config.head_dim,
                                       cache_config.kv_group_size, cache_config.kv_zero_point,
                                       cache_config.kv_rotate)
        exact = int_kv_exact_tokens(cache_config.kv_cache_dtype, cache_config.kv_exact_tokens) if self.kv_format else 0
        # the integer cache's exact window (kernels/attention/kv_exact.py): a ring row per schedulable sequence
        self.exact_rows = ExactRowTable(max_num_seqs, exact, self.device) if exact else None
        self.sampler = Sampler(seed=seed)
        self.num_tokens_forwarded = 0        # tokens run through the model (prefix hits are not)
        self.kv_observer = None              # sees every layer's new K/V before the store (calibration)
        self._first_forward_observer: KVRangeObserver | None = None
        self._allocate_kv_cache()
        self.decode_graphs: DecodeGraphs | None = None
        self.verify_graphs: VerifyGraphs | VerifyRowGraphs | None = None
        self.cpu_tier = CpuKVTier(self.block_tensors, num_cpu_blocks) if num_cpu_blocks else None
        self.lora = None                     # engine/lora/manager.py's LoRAManager with --enable-lora

    def plan_decode_graphs(self, max_batch: int, max_model_len: int) -> DecodeGraphs:
        """The decode graphs this engine will capture (CUDA only); capture_decode_graphs captures them."""
        self.decode_graphs = DecodeGraphs(self.model, max_batch, max_model_len, self.block_size, self.device,
                                          self.model_config.num_kv_heads, self.kv_dtype in FP8_DTYPES,
                                          exact=self.exact_rows, lora=self.lora)
        return self.decode_graphs

    def capture_decode_graphs(self, show_progress: bool = False) -> None:
        """CUDA only; the first forward (scale calibration / range check) still runs eagerly."""
        self.decode_graphs.capture(show_progress)

    def plan_verify_graphs(self, max_batch: int, tokens_per_seq: int, max_model_len: int,
                           as_rows: bool | None = None) -> VerifyGraphs | VerifyRowGraphs:
        """The verification graphs (CUDA only; speculation with k = tokens_per_seq - 1 proposals, on up to max_batch
        sequences); capture_verify_graphs captures them, after the decode graphs, whose memory pool they share.
        as_rows: one decode row per token (VerifyRowGraphs); None: as KernelOptions.verify_rows says."""
        if as_rows is None:
            as_rows = options_for(self.device).verify_rows
        if as_rows:
            self.verify_graphs = VerifyRowGraphs(self.model, max_batch, tokens_per_seq, max_model_len,
                                                 self.block_size, self.device, self.model_config.num_kv_heads,
                                                 self.kv_is_fp8)
        else:
            self.verify_graphs = VerifyGraphs(self.model, max_batch, tokens_per_seq, max_model_len, self.block_size,
                                              self.device)
        return self.verify_graphs

    def capture_verify_graphs(self, show_progress: bool = False) -> None:
        self.verify_graphs.capture(show_progress, self.decode_graphs.pool if self.decode_graphs else None)

    @property
    def observes_kv(self) -> bool:
        """The next forward hands K/V to an observer (calibration or the first-forward range check)."""
        return self.kv_observer is not None or self._first_forward_observer is not None

    @property
    def kv_name(self) -> str:
        """The cache's dtype as --kv-cache-dtype names it (int4 / int8 for integer caches)."""
        if self.kv_format is not None:
            return f"int{self.kv_format.bits}"
        return str(self.kv_dtype).replace("torch.", "")

    @property
    def kv_description(self) -> str:
        """kv_name with an integer cache's grouping, rotation and exact window (the start-up log, eval's report)."""
        if self.kv_format is None:
            return self.kv_name
        exact = self.exact_rows.size if self.exact_rows is not None else 0
        return self.kv_format.describe(self.model_config.head_dim, exact)

    @property
    def kv_is_fp8(self) -> bool:
        return self.kv_dtype in FP8_DTYPES

    def set_kv_scales(self, scales: list[tuple[float, float]] | None) -> None:
        """Per-layer (k_scale, v_scale) for an fp8 cache; None computes them inside the first forward. Either
        way the first forward checks every layer's K and V against the fp8 range (warns when they were clamped)."""
        if not self.kv_is_fp8:
            return
        layers = self.model.attention_layers
        for attn, (k_scale, v_scale) in zip(layers, scales or []):
            attn.k_scale.fill_(k_scale)
            attn.v_scale.fill_(v_scale)
        fp8_max = float(torch.finfo(self.kv_dtype).max)
        self._first_forward_observer = KVRangeObserver(layers, set_scales_for=fp8_max if scales is None else None)

    def _allocate_kv_cache(self) -> None:
        cfg = self.model_config
        shape = (self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_caches, self.v_caches, self.kv_scale_blocks = allocate_kv_cache(
            self.model.attention_layers, shape, self.kv_dtype, self.kv_format, self.device,
            (self.exact_rows.spare + 1, self.exact_rows.size, self.dtype) if self.exact_rows else None)

    @property
    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by KV block id ([num_blocks, ...]): what a block copy or swap moves."""
        return self.k_caches + self.v_caches + self.kv_scale_blocks

    def kv_bytes_per_block(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.block_tensors)

    def apply_transfers(self, out: SchedulerOutput) -> None:
        """Swaps and copies of a step; before the forward that reads them, and also when nothing is scheduled."""
        if self.cpu_tier is not None:
            self.cpu_tier.issue(out.blocks_to_swap_out, out.blocks_to_swap_in)
            self.cpu_tier.wait()
        self.copy_blocks(out.blocks_to_copy)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = to_device([s for s, _ in pairs], torch.long, self.device)
        dst = to_device([d for _, d in pairs], torch.long, self.device)
        for cache in self.block_tensors:
            cache[dst] = cache[src]

    def step_path(self, out: SchedulerOutput, carry: "Carry | None" = None, verify: bool = False,
                  observer=None) -> str:
        """How a step runs, chosen here only: "verify graph" (verify: every entry's inputs on the host, each at most
        k + 1 tokens, few enough entries), "decode graph" (one token per sequence) or "eager" (anything else, and
        any forward whose K/V go to an observer: calibration runs outside graphs)."""
        if observer is not None:
            return "eager"
        lengths = [item.num_new_tokens for item in out.scheduled]
        if verify and carry is None and self.verify_graphs is not None and self.verify_graphs.can_run(lengths):
            return "verify graph"
        if self.decode_graphs is not None and self.decode_graphs.can_run(len(lengths), sum(lengths)):
            return "decode graph"
        return "eager"

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput, carry: "Carry | None" = None, greedy: bool = False,
                verify: bool = False) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """The step's transfers, then the model over the scheduled tokens: (hidden [T, hidden], row starts, None).
        carry: the step in flight whose sampled tokens are inputs here (sequences with a pending token). greedy
        (every row samples its argmax): a decode graph with the head and the argmax inside may run, and the third
        value is then its token ids [T]. verify (a verification step: logits of every row wanted): a verify graph
        with the head inside may run, and the third value is then the fp32 logits of every row [T, vocab]."""
        prepared = self.prepare_forward(out, carry.rows if carry is not None else None, greedy, verify)
        return self.run_forward(prepared, carry.tokens if carry is not None else None)

    def prepare_forward(self, out: SchedulerOutput, carry_rows: dict[int, int] | None = None, greedy: bool = False,
                        verify: bool = False) -> PreparedForward:
        """forward()'s host half: the path, the packed inputs (their copies queued), the swaps issued. Needs only
        where the carried tokens will be (carry_rows), so it may run before the step in flight is even sampled."""
        if self.cpu_tier is not None:   # async on CUDA: the host prepares the batch meanwhile
            self.cpu_tier.issue(out.blocks_to_swap_out, out.blocks_to_swap_in)
        first = self._first_forward_observer if self.kv_observer is None else None
        observer = self.kv_observer or first
        path = self.step_path(out, carry_rows, verify, observer)
        prepared = PreparedForward(out, path, greedy, first)
        if path == "verify graph":
            prepared.bucket, prepared.packed, prepared.starts = self.verify_graphs.pack_step(out.scheduled)
        elif path == "decode graph":
            prepared.shape, prepared.packed, prepared.carries = self.decode_graphs.pack_step(
                [item.seq for item in out.scheduled], carry_rows)
            prepared.starts = list(range(len(out.scheduled) + 1))
        else:
            prepared.input_ids, prepared.positions, prepared.meta, prepared.starts, prepared.fill = \
                eager_inputs(out, carry_rows, self.block_size, self.device)
            prepared.meta.kv_observer = observer
            if self.exact_rows is not None:
                prepared.meta.exact_rows = self.exact_rows.step(out.scheduled)
            if self.lora is not None:
                prepared.lora_slots = self.lora.step_slots(out.scheduled)
        return prepared

    def run_forward(self, prepared: PreparedForward, carried: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """forward()'s device half: queues the copies, the carried tokens (carried: the samples of the step in
        flight) and the model."""
        out, path = prepared.out, prepared.path
        num_tokens = sum(item.num_new_tokens for item in out.scheduled)
        if self.cpu_tier is not None:
            self.cpu_tier.wait()
        self.copy_blocks(out.blocks_to_copy)
        third = None
        if path == "verify graph":
            hidden, logits = self.verify_graphs.run(prepared.bucket, prepared.packed)
            hidden, third = hidden[:num_tokens], logits[:num_tokens]
        elif path == "decode graph":
            hidden, third = self.decode_graphs.run(len(out.scheduled), prepared.shape, prepared.packed,
                                                   carried if prepared.carries else None, prepared.greedy)
        else:
            if prepared.fill is not None:
                at, rows = prepared.fill
                prepared.input_ids[at] = carried[rows]
            if self.lora is not None:
                self.lora.batch.slots = prepared.lora_slots
            hidden = self.model(prepared.input_ids, prepared.positions, prepared.meta)
        first = prepared.first_observer
        if first is not None:
            self._first_forward_observer = None
            first.report(self.model.attention_layers, self.kv_dtype)
        self.num_tokens_forwarded += num_tokens
        return hidden, prepared.starts, third

    @torch.inference_mode()
    def compute_all_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits for every scheduled token (scoring / eval): [T, vocab] fp32. Samples nothing."""
        return self.model.compute_logits(self.forward(out)[0])

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[int | None], list[Logprob | None]]:
        """Runs one step. Returns (sampled token or None per scheduled entry, its Logprob or None).
        Prompt logprobs, when requested, are appended to each sequence's `prompt_logprobs`."""
        return self.launch(out).resolve()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, carry: "Carry | None" = None) -> "LaunchedStep":
        """execute() without the wait: the forward and the sampling are queued on the device; the host is free
        until LaunchedStep.resolve(). carry: see forward()."""
        return self.sample(self.launch_forward(out, carry))

    @torch.inference_mode()
    def launch_forward(self, out: SchedulerOutput, carry: "Carry | None" = None) -> "ForwardStep":
        """The first half of launch(): the forward and the logits queued on the device, nothing sampled yet. The
        engine samples it later when the sampling reads the previous tokens on the host (grammar masks, penalties,
        min_tokens), so that host work overlaps this forward."""
        return self.run_step(self.prepare_step(out, carry.rows if carry is not None else None),
                             carry.tokens if carry is not None else None)

    def prepare_step(self, out: SchedulerOutput, carry_rows: dict[int, int] | None = None) -> PreparedStep:
        """launch_forward()'s host half (prepare_forward), before the step in flight is sampled."""
        sample_seqs = [item.seq for item in out.scheduled if item.sample]
        argmax_only = only_argmax(sample_seqs)
        greedy = argmax_only and len(sample_seqs) == len(out.scheduled)
        return PreparedStep([item.sample for item in out.scheduled], sample_seqs, argmax_only,
                            self.prepare_forward(out, carry_rows, greedy))

    @torch.inference_mode()
    def run_step(self, prepared: PreparedStep, carried: torch.Tensor | None = None) -> "ForwardStep":
        """launch_forward()'s device half: the forward and the logits of the sampling rows, queued."""
        out = prepared.forward.out
        hidden, starts, graph_sampled = self.run_forward(prepared.forward, carried)    # [T, hidden]
        sample_rows = [starts[i + 1] - 1 for i, item in enumerate(out.scheduled) if item.sample]
        self._prompt_logprobs(out, hidden, starts)
        logits = None
        if graph_sampled is None and sample_rows:
            if len(sample_rows) == hidden.shape[0]:                          # every row samples (decodes)
                rows = hidden
            else:   # a list index would go through pageable memory, which waits for the step in flight
                rows = hidden[to_device(sample_rows, torch.long, hidden.device)]
            # [S, vocab]; fp32 unless every row only takes the argmax
            logits = self.model.compute_logits(rows, float32=not prepared.argmax_only)
        return ForwardStep(prepared.samples, prepared.sample_seqs, logits, graph_sampled)

    @torch.inference_mode()
    def sample(self, step: "ForwardStep") -> "LaunchedStep":
        """The second half of launch(): queues the sampling of a forwarded step."""
        pending = None
        if step.graph_sampled is not None:                                   # one row per sequence, all sample
            # the graph's static output: the device-to-host copy PendingSample queues now reads it before the next
            # replay writes it (a CPU tensor would be read later, at resolve: a copy)
            sampled = step.graph_sampled
            values = sampled if sampled.is_cuda else sampled.clone()
            pending = PendingSample(sampled, values, len(step.sample_seqs), [])
        elif step.logits is not None:
            pending = self.sampler.sample(step.logits, step.sample_seqs, frozenset(step.dropped))
        return LaunchedStep(step.samples, pending)

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor, starts: list[int]) -> None:
        for i, item in enumerate(out.scheduled):
            seq = item.seq
            if seq.params.prompt_logprobs is None:
                continue
            if not seq.prompt_logprobs:
                seq.prompt_logprobs.append(None)                              # the first token has no context
            # hidden row of position p predicts token p + 1; skip positions already done (recompute after preemption)
            begin = max(seq.num_computed_tokens, len(seq.prompt_logprobs) - 1)
            end = min(seq.num_computed_tokens + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if end <= begin:
                continue
            row0 = starts[i] + begin - seq.num_computed_tokens
            logits = self.model.compute_logits(hidden[row0: row0 + end - begin])
            seq.prompt_logprobs += compute_prompt_logprobs(logits, seq.token_ids[begin + 1: end + 1],
                                                           seq.params.prompt_logprobs)
