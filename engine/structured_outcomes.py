"""What a step's grammars decided besides its sampled tokens (issue 54), applied by the engine with that step's
tokens: sequences whose grammar failed end with an error, and forced chains (jump-forward) are appended."""
from quant_serve.engine.core.scheduler import Scheduler, SchedulerOutput
from quant_serve.engine.core.sequence import Sequence
from quant_serve.engine.worker.steps import ForwardStep
from quant_serve.engine.sample.structured_mask import GrammarMasks


def end_failed_grammars(grammars: GrammarMasks | None, scheduler: Scheduler, out: SchedulerOutput) -> list[Sequence]:
    """Sequences of `out` whose grammar failed while it sampled end with finish_reason "error" (the library's
    message in stop_reason) before its tokens apply, so the token sampled for them, which the grammar did not
    choose, is dropped; their blocks go back now. -> the sequences ended."""
    failures = grammars.take_failures() if grammars is not None else {}
    ended = []
    for item in out.scheduled:
        error = failures.pop(item.seq.request_id, None)
        if error is not None and not item.seq.is_finished:
            scheduler.finish(item.seq, "error", error)
            ended.append(item.seq)
    return ended


def append_forced(grammars: GrammarMasks | None, scheduler: Scheduler, out: SchedulerOutput, tokens: list,
                  ahead) -> list[tuple[Sequence, int]]:
    """The tokens a grammar forced behind the token its sequence just sampled: appended without a forward each.
    ahead: (out, step) launched behind `out`, which computes the sampled token's KV; what it samples for the
    sequence is dropped (ScheduledSeq.discard), and the step after computes the forced tokens' KV as one chunk.
    -> the (seq, token) appended."""
    chains = grammars.take_forced() if grammars is not None else {}
    if not chains:
        return []
    behind = {id(item.seq): item for item in ahead[0].scheduled} if ahead is not None else {}
    applied = []
    for item, token in zip(out.scheduled, tokens):
        chain = chains.pop(item.seq.request_id, None)
        if chain is None:
            continue
        seq = item.seq
        if seq.is_finished or token != chain[0]:     # ended by its token, or sampled another (logit_bias)
            grammars.unforce(seq.request_id, len(chain) - (token == chain[0]))
            continue
        applied += scheduler.apply_forced(seq, chain[1:])
        if id(seq) in behind:
            behind[id(seq)].discard = True
            if isinstance(ahead[1], ForwardStep):     # not sampled yet: no draw for it (seeded rows)
                ahead[1].dropped.add(id(seq))
    for seq_id, chain in chains.items():             # not in this step (aborted meanwhile)
        grammars.unforce(seq_id, len(chain))
    return applied
