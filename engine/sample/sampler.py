"""Next-token sampling: logit bias, penalties, min_tokens, temperature, min-p / top-k / top-p, seeds, logprobs.

Order per row follows vLLM: grammar mask -> logit_bias -> penalties -> min_tokens masking -> temperature -> min_p ->
top_k -> top_p -> sample. The grammar mask (structured outputs) sets the tokens a row's grammar does not allow to -inf,
so nothing after it can bring them back.
Logprobs are taken from the raw model logits (vLLM's default "raw_logprobs"), not from the processed ones.
"""
from dataclasses import dataclass

import torch

from quant_serve.engine.core.sequence import Logprob, Sequence
from quant_serve.engine.sample.structured_mask import GrammarMasks
from quant_serve.engine.worker.transfer import start_to_host, to_device
from quant_serve.kernels.argmax import argmax_rows

# Temperatures below this are treated as greedy: dividing by them overflows fp32 (vLLM uses the same cut-off).
_SAMPLING_EPS = 1e-5


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprob | None]     # None for sequences whose params.logprobs is None


@dataclass
class PendingSample:
    """A sample still on the device: its one device-to-host copy is queued when it is made; resolve() waits for it
    (i.e. for this step, not for steps launched after it), so the host can do other work in between."""
    token_ids: torch.Tensor            # [S] int64, on the device (the next step's input before the host has it)
    values: torch.Tensor               # [S] int64 token ids, or float64 ids + chosen logprobs (+ top ids, top logprobs)
    num_seqs: int
    rows: list[int]                    # rows that want logprobs
    k: int = 0                         # top alternatives computed per such row
    wanted: list[int] | None = None    # alternatives each such row asked for (<= k)

    def __post_init__(self):
        self._host = start_to_host(self.values)          # queued now, behind this step only

    def resolve(self) -> SamplerOutput:
        num_seqs = self.num_seqs
        if not self.rows:
            return SamplerOutput(token_ids=self._host.wait().tolist(), logprobs=[None] * num_seqs)
        flat, k = self._host.wait().tolist(), self.k
        token_ids = [int(t) for t in flat[:num_seqs]]
        chosen_lp = flat[num_seqs:2 * num_seqs]
        top_ids_flat = flat[2 * num_seqs:2 * num_seqs + len(self.rows) * k]
        top_lp_flat = flat[2 * num_seqs + len(self.rows) * k:]
        logprobs: list[Logprob | None] = [None] * num_seqs
        for r, (i, n) in enumerate(zip(self.rows, self.wanted)):
            top = [(int(top_ids_flat[r * k + j]), top_lp_flat[r * k + j]) for j in range(n)]
            logprobs[i] = Logprob(token_id=token_ids[i], logprob=chosen_lp[i], top=top)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def _is_greedy(seq: Sequence) -> bool:
    return seq.params.temperature < _SAMPLING_EPS


def _has_penalties(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _has_logit_bias(seq: Sequence) -> bool:
    return bool(seq.params.logit_bias)


def _min_tokens_active(seq: Sequence) -> bool:
    # the tokens the sequence has: under async scheduling the token being sampled is already counted as pending
    return len(seq.token_ids) - seq.num_prompt_tokens < seq.params.min_tokens


def _constrained(seq: Sequence) -> bool:
    return seq.params.structured_outputs is not None


def needs_last_token_on_host(seq: Sequence) -> bool:
    """Penalties, min_tokens until it is reached, and a grammar (its matcher takes each token before the next mask)
    read the sequence's tokens on the host: its next token can only be sampled once the last one is there (the
    step behind it queues its forward first, then waits, then samples)."""
    return _has_penalties(seq) or _min_tokens_active(seq) or _constrained(seq)


def only_argmax(seqs: list[Sequence]) -> bool:
    """Every row takes the argmax of its raw logits: greedy, no bias, no penalties, no min_tokens, no logprobs, no
    grammar."""
    return all(_is_greedy(s) and not _has_logit_bias(s) and not _has_penalties(s) and not _min_tokens_active(s)
               and s.params.logprobs is None and not _constrained(s) for s in seqs)


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return to_device([r + [pad] * (width - len(r)) for r in rows], torch.long, device)


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Adds each row's params.logit_bias (token id -> value) to its logits: one index_add_ over the flat [S * V]
    view for the whole batch. Token ids were checked against the vocabulary when the request was added."""
    vocab = logits.shape[1]
    flat_ids, values = [], []          # row * vocab + token, bias
    for i, seq in enumerate(seqs):
        bias = seq.params.logit_bias
        if bias:
            flat_ids += [i * vocab + t for t in bias]
            values += bias.values()
    if not flat_ids:
        return logits
    logits = logits.clone()                                                                      # contiguous [S, V]
    logits.view(-1).index_add_(0, to_device(flat_ids, torch.long, logits.device),
                               to_device(values, torch.float32, logits.device).to(logits.dtype))
    return logits


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens; presence / frequency penalties over output tokens only.

    logits: [S, V] fp32. Returns a new tensor; rows without penalties are unchanged.
    """
    rows = [i for i, s in enumerate(seqs) if _has_penalties(s)]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    pen_seqs = [seqs[i] for i in rows]
    # Token ids are scattered into [R, V + 1]; the extra column absorbs the padding id `vocab`.
    out_ids = _padded([s.output_token_ids for s in pen_seqs], vocab, device)                    # [R, Lo]
    all_ids = _padded([s.prompt_token_ids + s.output_token_ids for s in pen_seqs], vocab, device)  # [R, L]
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=counts.dtype))
    counts = counts[:, :vocab]                                                                   # [R, V]
    seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, all_ids, True)
    seen = seen[:, :vocab]                                                                       # [R, V]

    rep = to_device([s.params.repetition_penalty for s in pen_seqs], torch.float32, device)[:, None]
    presence = to_device([s.params.presence_penalty for s in pen_seqs], torch.float32, device)[:, None]
    frequency = to_device([s.params.frequency_penalty for s in pen_seqs], torch.float32, device)[:, None]

    row_idx = to_device(rows, torch.long, device)
    x = logits[row_idx]                                                                          # [R, V]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - frequency * counts - presence * (counts > 0).float()
    logits = logits.clone()
    logits[row_idx] = x
    return logits


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence], complete: frozenset[int] = frozenset()
                     ) -> torch.Tensor:
    """Forbid EOS and stop token ids while a sequence has fewer than params.min_tokens output tokens. complete: rows
    whose grammar allows nothing but EOS, which then wins (the sequence goes on with EOS until min_tokens)."""
    vocab = logits.shape[1]
    flat_ids = []          # row * vocab + token
    for i, seq in enumerate(seqs):
        if _min_tokens_active(seq) and i not in complete:
            banned = set(seq.eos_token_ids) | set(seq.params.stop_token_ids)
            flat_ids += [i * vocab + t for t in sorted(banned) if 0 <= t < vocab]
    if not flat_ids:
        return logits
    logits = logits.clone()                                                                      # contiguous [S, V]
    # index_fill_ on the flat view: assigning a scalar through advanced indexing syncs with the device
    logits.view(-1).index_fill_(0, to_device(flat_ids, torch.long, logits.device), float("-inf"))
    return logits


def _apply_min_p_top_k_top_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [R, V] already divided by temperature. Returns logits with filtered tokens at -inf."""
    device, vocab = logits.device, logits.shape[1]
    if any(s.params.min_p > 0 for s in seqs):
        min_p = to_device([s.params.min_p for s in seqs], torch.float32, device)[:, None]       # [R, 1]
        probs = logits.softmax(dim=-1)
        threshold = min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))

    use_top_k = any(s.params.top_k > 0 for s in seqs)
    use_top_p = any(s.params.top_p < 1.0 for s in seqs)
    if not (use_top_k or use_top_p):
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)                           # [R, V]
    if use_top_k:
        k = to_device([s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in seqs],
                       torch.long, device)
        kth_largest = sorted_logits.gather(1, (vocab - k)[:, None])                              # [R, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if use_top_p:
        top_p = to_device([s.params.top_p for s in seqs], torch.float32, device)[:, None]
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop the low tail whose total mass is at most 1 - top_p; the best token always stays
        drop = cum <= 1.0 - top_p
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def sampling_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The distribution a random row samples from: logits [R, V] fp32 of non-greedy rows without bias, penalties
    or min_tokens -> probabilities [R, V] after temperature, min_p, top_k and top_p (speculative verification)."""
    temperature = to_device([s.params.temperature for s in seqs], torch.float32, logits.device)[:, None]
    return _apply_min_p_top_k_top_p(logits / temperature, seqs).softmax(dim=-1)


class Sampler:
    def __init__(self, seed: int = 0, grammars: GrammarMasks | None = None):
        self.seed = seed
        self._generator: torch.Generator | None = None        # for unseeded rows
        self._request_generators: dict[str, torch.Generator] = {}
        self.grammars = grammars              # the matchers of constrained sequences (structured outputs)

    def release(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.release(request_id)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def _request_generator(self, seq: Sequence, device: torch.device) -> torch.Generator:
        gen = self._request_generators.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seq.params.seed)
            self._request_generators[seq.request_id] = gen
        return gen

    def generator_for(self, seq: Sequence, device: torch.device) -> torch.Generator:
        """The generator a row's random draws come from: its own when seeded, else the shared one."""
        return self._shared_generator(device) if seq.params.seed is None else self._request_generator(seq, device)

    def _sample_random(self, logits: torch.Tensor, seqs: list[Sequence], dropped: frozenset[int] = frozenset()
                       ) -> torch.Tensor:
        """logits: [R, V] penalized rows of non-greedy sequences. Returns sampled ids [R]."""
        device = logits.device
        temperature = to_device([s.params.temperature for s in seqs], torch.float32, device)[:, None]
        logits = _apply_min_p_top_k_top_p(logits / temperature, seqs)
        probs = logits.softmax(dim=-1)                                                           # [R, V]

        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p. Each seeded row draws its noise
        # from its own generator, so its tokens do not depend on the rest of the batch.
        noise = torch.empty_like(probs)
        unseeded = [j for j, s in enumerate(seqs) if s.params.seed is None]
        if len(unseeded) == len(seqs):
            noise.exponential_(generator=self._shared_generator(device))
        elif unseeded:
            noise[to_device(unseeded, torch.long, device)] = torch.empty(
                len(unseeded), probs.shape[1], device=device).exponential_(
                generator=self._shared_generator(device))
        for j, seq in enumerate(seqs):
            if seq.params.seed is not None and (seq.is_finished or id(seq) in dropped):
                # ended since its step was scheduled (sampled behind the next step, its generator is released), or
                # its token is dropped (forced tokens followed its last one): a token nobody reads, no draw from its
                # generator (the draws stay those of step-by-step decoding) and none that would outlive the request
                noise[j].fill_(1.0)
            elif seq.params.seed is not None:
                noise[j].exponential_(generator=self._request_generator(seq, device))
        # exponential_ can return 0; tiny keeps p / E finite (p <= 1) and 0 / E == 0 for masked tokens
        return (probs / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        return self.sample(logits, seqs).resolve()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], dropped: frozenset[int] = frozenset()
               ) -> PendingSample:
        """Queues the sampling of one token per row of logits [S, V]; nothing waits for the GPU. dropped: ids of
        the sequences whose token the engine will drop."""
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), (tuple(logits.shape), len(seqs))
        if only_argmax(seqs):          # the model's dtype is fine: widening to fp32 is exact and keeps the order
            sampled = argmax_rows(logits)                                                        # [S]
            return PendingSample(sampled, sampled, len(seqs), [])
        logits = logits.float()                                                                  # [S, V]
        want_logprobs = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None                     # [S, V]
        complete = frozenset()
        if any(_constrained(s) for s in seqs):     # in place: the runner's logits are this step's alone
            if self.grammars is None:
                raise RuntimeError("a sequence with structured_outputs reached a sampler without grammars")
            complete = self.grammars.apply(logits, seqs)

        simple = all(_is_greedy(s) and not _has_logit_bias(s) and not _has_penalties(s) and
                     not _min_tokens_active(s) for s in seqs)
        if simple:
            sampled = logits.argmax(dim=-1)                                                      # [S]
        else:
            logits = apply_min_tokens(apply_penalties(apply_logit_bias(logits, seqs), seqs), seqs, complete)
            sampled = logits.argmax(dim=-1)          # the answer for greedy rows
            random_rows = [i for i, s in enumerate(seqs) if not _is_greedy(s)]
            if random_rows:
                idx = to_device(random_rows, torch.long, logits.device)
                sampled[idx] = self._sample_random(logits[idx], [seqs[i] for i in random_rows], dropped)

        if not want_logprobs:
            return PendingSample(sampled, sampled, len(seqs), [])
        return self._with_logprobs(sampled, raw_logprobs, seqs, want_logprobs)

    def _with_logprobs(self, sampled: torch.Tensor, raw_logprobs: torch.Tensor, seqs: list[Sequence],
                       rows: list[int]) -> PendingSample:
        k = min(max(seqs[i].params.logprobs for i in rows), raw_logprobs.shape[1])
        idx = to_device(rows, torch.long, sampled.device)
        chosen = raw_logprobs.gather(1, sampled[:, None])[:, 0]                                  # [S]
        parts = [sampled.double(), chosen.double()]
        if k > 0:
            top_lp, top_ids = raw_logprobs[idx].topk(k, dim=-1)                                  # [R, k]
            parts += [top_ids.flatten().double(), top_lp.flatten().double()]
        # One device-to-host copy (queued by PendingSample): ids (< 2**53) and fp32 logprobs are exact in float64.
        return PendingSample(sampled, torch.cat(parts), len(seqs), rows, k,
                             [min(seqs[i].params.logprobs, k) for i in rows])


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: list[int], k: int) -> list[Logprob]:
    """logits: [P, V], row j predicts target_ids[j]. Returns one Logprob per row with the k best alternatives."""
    assert logits.dim() == 2 and logits.shape[0] == len(target_ids), (tuple(logits.shape), len(target_ids))
    num = len(target_ids)
    if num == 0:
        return []
    k = min(k, logits.shape[1])
    logprobs = logits.float().log_softmax(dim=-1)                                                # [P, V]
    targets = to_device(target_ids, torch.long, logits.device)
    parts = [logprobs.gather(1, targets[:, None])[:, 0].double()]                                # [P]
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)                                               # [P, k]
        parts += [top_ids.flatten().double(), top_lp.flatten().double()]
    flat = torch.cat(parts).tolist()     # one device-to-host copy, as in Sampler._with_logprobs
    target_lp, top_ids_flat, top_lp_flat = flat[:num], flat[num:num + num * k], flat[num + num * k:]
    out = []
    for j, target in enumerate(target_ids):
        top = [(int(top_ids_flat[j * k + c]), top_lp_flat[j * k + c]) for c in range(k)]
        out.append(Logprob(token_id=target, logprob=target_lp[j], top=top))
    return out
