"""LLMEngine: add_request / abort / step, and a blocking generate(). The same object serves CLI, server and eval."""
import dataclasses
import logging
import time
from collections import Counter

import torch

from quant_serve.engine import offline
from quant_serve.engine.worker import kv_pool
from quant_serve.engine.core.block_manager import BlockManager
from quant_serve.engine.config import EngineConfig, resolve_max_model_len
from quant_serve.engine.core.detokenizer import IncrementalDetokenizer
from quant_serve.engine.worker.kv_scales import resolve_kv_scales
from quant_serve.engine.lora import manager as lora
from quant_serve.engine.load.loader import (default_device, load_model, load_model_config, load_tokenizer, pick_dtype,
                                            resolve_model_dir)
from quant_serve.engine.worker.model_runner import ModelRunner
from quant_serve.engine.worker.steps import Carry, ForwardStep, LaunchedStep, carry_rows
from quant_serve.engine.outputs import EngineStats, Request, RequestMetrics, RequestOutput
from quant_serve.engine.sample.sampler import needs_last_token_on_host
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.core.requests import check_request, encode_prompt
from quant_serve.engine.core.scheduler import Scheduler, SchedulerOutput
from quant_serve.engine.core.sequence import Sequence
from quant_serve.engine.spec.proposer import DraftTarget, make_proposer
from quant_serve.engine.spec.runtime import Speculation
from quant_serve.engine.worker.startup import device_name, start_kernels
from quant_serve.engine.worker.kv_exact_rows import exact_window_start
from quant_serve.engine.sample.structured import GrammarCompiler
from quant_serve.engine.sample.structured_mask import GrammarMasks
from quant_serve.engine.structured_outcomes import append_forced, end_failed_grammars
from quant_serve.kernels.gpu import configure
from quant_serve.quant.activations import check_activation_device, plan_activations

logger = logging.getLogger("quant_serve")


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        self.config = config
        begin = time.perf_counter()
        self.model_dir = resolve_model_dir(config.model, config.revision)
        self.model_config, _ = load_model_config(self.model_dir)
        self.tokenizer = load_tokenizer(config.tokenizer or str(self.model_dir))
        self.device = default_device() if config.device == "auto" else config.device
        quantized = (self.model_config.quantization_config is not None and config.quantization != "none") or \
            (config.quantization or "").lower().startswith("gguf:")
        self.dtype = pick_dtype(config.dtype, self.model_config, self.device, quantized)
        self.max_model_len = resolve_max_model_len(self.model_config, config.max_model_len)
        config.scheduler.max_model_len = self.max_model_len
        torch.manual_seed(config.seed)
        check_activation_device(config.kernels, self.device)
        if self.device != "cpu":            # before any weight is prepared: the layouts follow the runtime's caps
            configure(torch.device(self.device), config.kernels)
        start = time.perf_counter()
        logger.info("config, tokenizer and device (%s) ready in %.1f s", device_name(self.device), start - begin)
        self.model, self.quant_config = load_model(self.model_dir, self.model_config, self.dtype, self.device,
                                                   config.load_format, config.quantization, show_progress,
                                                   config.seed, config.quantize_lm_head)
        logger.info("weights loaded and prepared in %.1f s", time.perf_counter() - start)
        self.activations = plan_activations(self.model, config.kernels, self.device)
        self.lora = lora.start(self.model, config, self.dtype, self.device) if config.lora.enable_lora else None
        exact_window_start(config, self.device)
        num_blocks, self.memory_plan, self.max_model_len = kv_pool.num_gpu_blocks(
            config, self.model_config, self.model_dir, self.device, self.dtype, self.max_model_len)
        config.scheduler.max_model_len = self.max_model_len
        num_cpu_blocks = kv_pool.num_cpu_blocks(config, self.model_config, self.dtype)
        self.runner = ModelRunner(self.model, self.model_config, config.cache, num_blocks, self.device, self.dtype,
                                  config.seed, num_cpu_blocks, config.scheduler.max_num_seqs)
        self.runner.lora = self.lora
        self.runner.set_kv_scales(resolve_kv_scales(
            config.cache.kv_scale_source, self.runner.kv_dtype, self.model_dir,
            getattr(self.model, "checkpoint_kv_scales", {}), self.model_config.num_layers))
        if self.device != "cpu":                # the CPU path runs the torch twins: nothing to compile
            start_kernels(self.runner, self.model, config, self.max_model_len, show_progress)
        # structured outputs: grammars compile against the tokenizer (lazily, on the first constrained request) and
        # the sampler masks the constrained rows of each step
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                self.model_config.eos_token_ids)
        self.runner.sampler.grammars = GrammarMasks(self.grammar_compiler, config.structured_forced_tokens)
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                          num_cpu_blocks)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.requests: dict[str, Request] = {}
        self._seq_owner: dict[str, tuple[Request, int]] = {}
        self._pending: list[tuple[Sequence, int]] = []   # tokens of the last step, not yet detokenized
        self._errored: list[Sequence] = []               # ended by a failed grammar, their output not yet made
        self._inflight: tuple[SchedulerOutput, LaunchedStep] | None = None   # launched, not yet resolved
        self._ahead = None     # (out, step) launched behind the step whose tokens are being applied
        self.stats = EngineStats()
        self.speculation = Speculation(config.speculative, self.scheduler, self.runner,
                                       make_proposer(config.speculative, self.draft_target()))
        self._log_ready(num_blocks, num_cpu_blocks)

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, n: int = 1) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        text, ids = encode_prompt(self.tokenizer, self.model_config.vocab_size, prompt)
        check_request(len(ids), params, self.max_model_len, self.model_config.vocab_size)
        if params.structured_outputs is not None:      # a constraint that cannot compile is refused here
            self.grammar_compiler.compile(params.structured_outputs)
        lora_id = lora.lora_id(self.lora, params.lora_name)
        now = time.time() if arrival_time is None else arrival_time
        seqs, detoks = [], []
        for i in range(n):
            child = params if n == 1 or params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            seq_id = request_id if n == 1 else f"{request_id}#{i}"
            seq = Sequence(seq_id, ids, child, arrival_time=now, eos_token_ids=self.model_config.eos_token_ids,
                           lora_id=lora_id)
            seqs.append(seq)
            detoks.append(IncrementalDetokenizer(self.tokenizer, ids, child))
        request = Request(request_id, text, ids, params, seqs, detoks, RequestMetrics(arrival_time=now),
                          [0] * n)
        self.requests[request_id] = request
        for i, seq in enumerate(seqs):
            self._seq_owner[seq.request_id] = (request, i)
            self.scheduler.add_sequence(seq)
        self.stats.prompt_tokens_total += len(ids) * n

    # ---- LoRA adapters (engine/lora/manager.py) -----------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str) -> None:
        """Loads an adapter into a free slot (ValueError naming the problem)."""
        lora.require(self.lora, "load").load(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Frees an adapter's slot; refused while an unfinished request uses it."""
        users = sum(r.params.lora_name == name for r in self.requests.values())
        lora.require(self.lora, "unload").unload(name, users)

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            self.scheduler.abort(seq.request_id)
            self.runner.sampler.release(seq.request_id)
            self.speculation.release(seq.request_id)
            self._seq_owner.pop(seq.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the outputs of the steps resolved before it (see _emit_pending). With async
        scheduling the step stays in flight when the call returns: the next call schedules and launches the
        following step on the in-flight one's pending tokens (their values gathered on the device) before waiting
        for it, so the host's bookkeeping between two steps no longer leaves the GPU idle."""
        prev, self._inflight = self._inflight, None
        if self.speculation.active():
            return self._speculative_step(prev)
        if prev is None:
            launched = self._schedule_and_launch(None)
            outputs = self._emit_pending()
        else:
            launched, outputs = self._step_behind(prev)
        self._keep_in_flight(launched)
        return outputs

    def _speculative_step(self, prev) -> list[RequestOutput]:
        """A step while speculation is on: proposals need the last tokens on the host, so a step in flight is
        resolved first; then a verification step, or an ordinary one where nothing was proposed."""
        outputs = self._emit_pending()         # stop strings end their sequences before any proposal
        if prev is not None:
            self.scheduler.advance(prev[0])
            self._apply(*prev)
            return outputs
        if self.speculation.propose_and_verify(self.schedule_step, self.accept_tokens):
            return outputs
        launched = self._schedule_and_launch(None)
        outputs += self._emit_pending()
        self._keep_in_flight(launched)
        return outputs

    def _step_behind(self, prev) -> tuple:
        """The next step, launched before prev's tokens reach the host (nothing ahead while K/V go to an observer).
        _emit_pending always runs before the next _apply: a stop string it finds ends the sequence before any later
        token of it is applied. -> (the launched step or None, outputs)."""
        if self.runner.observes_kv:
            outputs = self._emit_pending()
            self.scheduler.advance(prev[0])
            self._apply(*prev)
            return self._schedule_and_launch(None), outputs
        self.scheduler.advance(prev[0])
        if isinstance(prev[1], ForwardStep):
            return self._sample_behind(prev)
        launched = self._schedule_and_launch(prev[1].carry(prev[0]))
        outputs = self._emit_pending()
        self._apply(*prev, ahead=launched)
        return launched, outputs

    def _sample_behind(self, prev) -> tuple:
        """prev was forwarded without its sampling, which reads the tokens before it on the host (grammar masks,
        begun in a worker thread when those tokens were applied; penalties; min_tokens): the next step is scheduled
        and prepared first, then prev is sampled and the next forward queued behind it, so that the host's work on
        the next step overlaps the masks and prev's forward. -> (the launched step or None, outputs)."""
        out = self.schedule_step()
        prepared = None if out is None else self.runner.prepare_step(out, carry_rows(prev[0]))
        outputs = self._emit_pending()
        sampled = self.runner.sample(prev[1])
        launched = None if out is None else (out, self._run(out, prepared, sampled.carry(prev[0])))
        self._apply(prev[0], sampled, ahead=launched)
        return launched, outputs

    def _keep_in_flight(self, launched) -> None:
        """With async scheduling a launched step is resolved by the next call (the masks of a step whose sampling
        waits begin now: the tokens they follow are applied); without, now."""
        if launched is None:
            return
        if self.config.async_scheduling:
            self._inflight = launched
            grammars = self.runner.sampler.grammars
            if isinstance(launched[1], ForwardStep) and grammars is not None:
                grammars.start(launched[1].sample_seqs, self.model_config.vocab_size, frozenset(launched[1].dropped))
        else:
            self.scheduler.advance(launched[0])
            self._apply(*launched)

    def schedule_step(self) -> SchedulerOutput | None:
        """The next step's SchedulerOutput; None (its transfers done) when it schedules no sequence."""
        out = self.scheduler.schedule()
        self.stats.num_preemptions_total += len(out.preempted)
        self.count_transfers(out)
        if not out.scheduled:
            self.runner.apply_transfers(out)   # a step that only swapped out must still move the blocks
            return None
        now = time.time()
        for item in out.scheduled:
            request, _ = self._seq_owner[item.seq.request_id]
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
        return out

    def _schedule_and_launch(self, carry: Carry | None) -> tuple[SchedulerOutput, LaunchedStep | ForwardStep] | None:
        """Schedules the next step and queues it on the device: forward and sampling, or the forward alone where
        the sampling is left for later (_samples_behind)."""
        out = self.schedule_step()
        if out is None:
            return None
        return out, (self.runner.launch_forward(out, carry) if self._samples_behind(out) else
                     self.runner.launch(out, carry))

    def _run(self, out: SchedulerOutput, prepared, carry: Carry | None) -> LaunchedStep | ForwardStep:
        """Queues a prepared step, as _schedule_and_launch does."""
        step = self.runner.run_step(prepared, carry.tokens if carry is not None else None)
        return step if self._samples_behind(out) else self.runner.sample(step)

    def _samples_behind(self, out: SchedulerOutput) -> bool:
        """With async scheduling, a step whose sampling reads the previous tokens on the host (grammar masks,
        penalties, min_tokens) is sampled by the next step() call (_sample_behind), once they are there."""
        return self.config.async_scheduling and \
            any(item.sample and needs_last_token_on_host(item.seq) for item in out.scheduled)

    def _apply(self, out: SchedulerOutput, launched: LaunchedStep | ForwardStep, ahead=None) -> None:
        """Waits for an advanced step and applies its tokens; their text is made by the next _emit_pending. ahead:
        the step launched behind it (forced tokens drop its token for their sequences)."""
        if isinstance(launched, ForwardStep):       # its sampling was left for later: now
            launched = self.runner.sample(launched)
        self._ahead = ahead
        try:
            self.accept_tokens(out, *launched.resolve())
        finally:
            self._ahead = None

    def accept_tokens(self, out: SchedulerOutput, tokens: list, logprobs: list) -> None:
        """An advanced step's tokens (a list per entry for a verification step) and logprobs, applied to its
        sequences; their text is made by the next step's _emit_pending."""
        grammars = self.runner.sampler.grammars
        self._errored += end_failed_grammars(grammars, self.scheduler, out)
        for item, lp in zip(out.scheduled, logprobs):
            if lp is not None and item.advanced and not item.seq.is_finished:
                item.seq.output_logprobs.append(lp)
        self._pending += self.scheduler.apply_tokens(out, tokens)
        forced = append_forced(grammars, self.scheduler, out, tokens, self._ahead)
        self._pending += forced
        self.stats.structured_forced_tokens_total += len(forced)

    def drain(self) -> list[RequestOutput]:
        """Resolves a step still in flight and returns every output not yet returned."""
        outputs = self._emit_pending()
        if self._inflight is not None:
            out, launched = self._inflight
            self._inflight = None
            self.scheduler.advance(out)
            self._apply(out, launched)
        return outputs + self._emit_pending()

    def _emit_pending(self) -> list[RequestOutput]:
        """Text, stop strings and RequestOutputs for the tokens the last step sampled."""
        pending, self._pending = self._pending, []
        now = time.time()
        touched: dict[str, Request] = {}
        deltas: dict[tuple[str, int], tuple[str, list[int]]] = {}
        left = Counter(id(seq) for seq, _ in pending)     # a verified step emits several tokens per sequence
        stopped: set[int] = set()
        for seq, token in pending:
            left[id(seq)] -= 1
            owner = self._seq_owner.get(seq.request_id)
            if owner is None or id(seq) in stopped:   # aborted since, or a stop string ended it at an earlier token
                continue
            request, index = owner
            self.stats.generation_tokens_total += 1
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            text, stop = request.detokenizers[index].add_tokens([token])
            if stop is not None and (not seq.is_finished or left[id(seq)]):
                if seq.is_finished:             # by a later token of this step (EOS, length): the stop string wins
                    seq.finish_reason, seq.stop_reason = "stop", stop
                else:
                    self.scheduler.finish(seq, "stop", stop)
                stopped.add(id(seq))
                if left[id(seq)]:               # tokens after the stop string's are not part of the output
                    del seq.token_ids[-left[id(seq)]:]
            if seq.is_finished and (left[id(seq)] == 0 or id(seq) in stopped):
                text += request.detokenizers[index].finish()
                self.runner.sampler.release(seq.request_id)
                self.speculation.release(seq.request_id)
            old_text, old_ids = deltas.get((request.request_id, index), ("", []))
            deltas[(request.request_id, index)] = (old_text + text, old_ids + [token])
            touched[request.request_id] = request
        errored, self._errored = self._errored, []
        for seq in errored:                     # no token: the output only says that the sequence ended
            owner = self._seq_owner.get(seq.request_id)
            if owner is not None:
                touched[owner[0].request_id] = owner[0]
                self.runner.sampler.release(seq.request_id)
                self.speculation.release(seq.request_id)
        return [self._make_output(r, deltas, now) for r in touched.values()]

    def count_transfers(self, out: SchedulerOutput) -> None:
        """A step's KV block moves between the tiers, in the engine's statistics."""
        stats = self.stats
        stats.swapped_out_blocks_total += len(out.blocks_to_swap_out)
        stats.swapped_in_blocks_total += len(out.blocks_to_swap_in)
        stats.swap_bytes_total += (len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)) * \
            self.runner.kv_bytes_per_block()
        stats.cpu_prefix_hits_total = self.block_manager.cpu_prefix_hits

    def _make_output(self, request: Request, deltas, now: float) -> RequestOutput:
        output = request.output(deltas)
        if output.finished:
            request.metrics.finished_time = now
            self.requests.pop(request.request_id, None)
            for seq in request.seqs:
                self._seq_owner.pop(seq.request_id, None)
            self.stats.requests_finished_total += 1
        return output

    def draft_target(self) -> DraftTarget:
        """What a draft model must match and share: the target's tokenizer, limits, dtype, device and pool size."""
        return DraftTarget(self.tokenizer, self.max_model_len, self.config, self.dtype, self.device,
                           self.runner.num_blocks)

    def _log_ready(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """The engine's model, KV cache and CPU tier, once it is ready."""
        block_size = self.config.cache.block_size
        logger.info("model %s: %s, %s on %s; %s", self.model_dir, self.model_config.architecture,
                    str(self.dtype).replace("torch.", ""), self.device,
                    self.quant_config.describe() if self.quant_config else "unquantized")
        logger.info(self.activations.describe())
        logger.info("KV cache: %d blocks = %d tokens, max concurrency %.1f at max_model_len %d",
                    num_blocks, num_blocks * block_size, num_blocks * block_size / self.max_model_len,
                    self.max_model_len)
        if num_cpu_blocks:
            logger.info("KV CPU tier: %d blocks = %d tokens", num_cpu_blocks, num_cpu_blocks * block_size)

    # ---- offline -----------------------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]] | str, params: SamplingParams | list[SamplingParams] | None
                 = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Blocking batch generation; results in prompt order."""
        return offline.generate(self, prompts, params, use_tqdm)

    def score(self, token_ids: list[int], lora_name: str | None = None) -> torch.Tensor:
        """Logits at every position of `token_ids` through the paged path (engine/offline.py): [len, vocab] fp32."""
        return offline.score(self, token_ids, lora_name)

    @property
    def spec_stats(self):
        return self.speculation.stats

    @property
    def proposer(self):
        return self.speculation.proposer

    @property
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage
