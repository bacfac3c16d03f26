"""Proposers: where the k tokens a speculating sequence verifies come from."""
from dataclasses import dataclass

from quant_serve.engine.config import EngineConfig, SpeculativeConfig
from quant_serve.engine.sequence import Sequence
from quant_serve.engine.spec.backoff import Backoff
from quant_serve.engine.spec.ngram import propose_ngram
from quant_serve.engine.spec.step import num_to_propose


@dataclass(frozen=True)
class DraftTarget:
    """The target model's side of a proposer: the tokenizer a draft must share, the limits and the device it runs
    under, and the KV pool size its shadow sequences mirror."""
    tokenizer: object
    max_model_len: int
    config: EngineConfig
    dtype: object
    device: str
    num_blocks: int


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.backoff = Backoff(config.backoff_after)

    def propose(self, running: list[Sequence]) -> bool:
        """Sets spec_token_ids of the running sequences that find a match. -> whether any did."""
        found = False
        cfg = self.config
        for seq in running:
            k = num_to_propose(seq, cfg.num_speculative_tokens, self.max_model_len)
            seq.spec_token_ids = propose_ngram(seq.token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max) \
                if k and self.backoff.allow(seq) else []
            found |= bool(seq.spec_token_ids)
        return found

    def release(self, request_id: str) -> None:
        self.backoff.release(request_id)


def make_proposer(config: SpeculativeConfig, target: DraftTarget):
    if config.method == "ngram":
        return NgramProposer(config, target.max_model_len)
    from quant_serve.engine.spec.draft import DraftProposer
    return DraftProposer(config, target)
