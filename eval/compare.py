"""Perplexity and llama.cpp-style logit comparison (KL divergence, top-1 agreement, delta p of the correct token).

The reference runs first over every window; its log-probabilities of the scored positions go to a float32
memory-mapped file (the role of llama.cpp's --kl-divergence-base file), with its per-token NLL and argmax kept in
memory. Each candidate then runs window by window against that file, so only one window of logits of one model is
in memory at a time and the reference runs once however many candidates there are.
"""
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from quant_serve.eval.data import Window

ROWS_PER_CHUNK = 128     # KLD is computed this many positions at a time to bound the [rows, vocab] temporaries


@dataclass
class TokenStats:
    """Per scored token, in window order."""
    nll: np.ndarray                    # -log p(correct token), float64
    kld: np.ndarray | None = None      # KL(reference || candidate) per position, float64
    top1: np.ndarray | None = None     # argmax agrees with the reference's, bool
    delta_p: np.ndarray | None = None  # p_candidate(correct) - p_reference(correct), float64

    @property
    def perplexity(self) -> float:
        return math.exp(float(self.nll.mean()))

    def summary(self) -> dict:
        n = len(self.nll)
        out = {"num_tokens": n, "perplexity": self.perplexity, "nll": float(self.nll.mean()),
               "nll_stderr": float(self.nll.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0}
        out["perplexity_stderr"] = out["perplexity"] * out["nll_stderr"]
        if self.kld is not None:
            abs_dp = np.abs(self.delta_p)
            top1 = float(self.top1.mean())
            out.update({
                "kld": float(self.kld.mean()),
                "kld_stderr": float(self.kld.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
                "kld_median": float(np.median(self.kld)), "kld_p99": float(np.percentile(self.kld, 99)),
                "kld_max": float(self.kld.max()),
                "top1": top1, "top1_stderr": math.sqrt(top1 * (1 - top1) / n),
                "delta_p_mean": float(self.delta_p.mean()), "abs_delta_p_mean": float(abs_dp.mean()),
                "abs_delta_p_p99": float(np.percentile(abs_dp, 99)), "abs_delta_p_max": float(abs_dp.max()),
                "delta_p_rms": float(np.sqrt((self.delta_p ** 2).mean())),
            })
        return out


def _scored_logprobs(engine, window: Window, lora_name: str | None = None) -> torch.Tensor:
    """log_softmax of the rows that predict window.targets: [num_scored, vocab] fp32 on the CPU (under the LoRA
    adapter lora_name if given)."""
    logits = engine.score(window.tokens, lora_name)
    return torch.log_softmax(logits[window.first_scored - 1: len(window.tokens) - 1].float(), dim=-1)


class ReferenceStore:
    """The reference's scored log-probs on disk plus its per-token NLL and argmax. Use as a context manager."""

    def __init__(self, windows: list[Window], vocab_size: int, work_dir: str | None = None):
        self.windows = windows
        self.offsets = np.cumsum([0] + [w.num_scored for w in windows])
        self.vocab_size = vocab_size
        self._dir = Path(tempfile.mkdtemp(prefix="quant-serve-eval-", dir=work_dir))
        self.logprobs = np.lib.format.open_memmap(self._dir / "reference_logprobs.npy", mode="w+",
                                                  dtype=np.float32, shape=(int(self.offsets[-1]), vocab_size))
        self.nll = np.zeros(int(self.offsets[-1]), dtype=np.float64)
        self.argmax = np.zeros(int(self.offsets[-1]), dtype=np.int64)

    @property
    def num_bytes(self) -> int:
        return self.logprobs.nbytes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.logprobs = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def rows(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def fill(self, engine, desc: str = "reference", lora_name: str | None = None) -> TokenStats:
        check_vocab(engine, self.vocab_size, desc)
        for i, window in enumerate(tqdm(self.windows, desc=f"perplexity {desc}", unit="win")):
            lp = _scored_logprobs(engine, window, lora_name)
            targets = torch.tensor(window.targets)
            self.logprobs[self.rows(i)] = lp.numpy()
            self.nll[self.rows(i)] = -lp.gather(1, targets[:, None])[:, 0].double().numpy()
            self.argmax[self.rows(i)] = lp.argmax(dim=-1).numpy()
        self.logprobs.flush()
        return TokenStats(nll=self.nll.copy())

    def compare(self, engine, desc: str, lora_name: str | None = None) -> TokenStats:
        """Run the candidate on the same windows; per-token statistics against the stored reference."""
        check_vocab(engine, self.vocab_size, desc)
        n = int(self.offsets[-1])
        stats = TokenStats(nll=np.zeros(n), kld=np.zeros(n), top1=np.zeros(n, dtype=bool), delta_p=np.zeros(n))
        for i, window in enumerate(tqdm(self.windows, desc=f"perplexity {desc}", unit="win")):
            lc = _scored_logprobs(engine, window, lora_name)
            rows = self.rows(i)
            lr = torch.from_numpy(np.asarray(self.logprobs[rows]))
            targets = torch.tensor(window.targets)[:, None]
            lc_t, lr_t = lc.gather(1, targets)[:, 0].double(), lr.gather(1, targets)[:, 0].double()
            stats.nll[rows] = -lc_t.numpy()
            stats.delta_p[rows] = (lc_t.exp() - lr_t.exp()).numpy()
            stats.top1[rows] = (lc.argmax(dim=-1).numpy() == self.argmax[rows])
            stats.kld[rows] = kl_divergence(lr, lc).numpy()
        return stats


def kl_divergence(ref_logprobs: torch.Tensor, cand_logprobs: torch.Tensor) -> torch.Tensor:
    """sum_v p_ref (log p_ref - log p_cand) per row, float64 result, computed in row chunks."""
    out = []
    for a in range(0, ref_logprobs.shape[0], ROWS_PER_CHUNK):
        lr, lc = ref_logprobs[a:a + ROWS_PER_CHUNK], cand_logprobs[a:a + ROWS_PER_CHUNK]
        out.append((lr.exp() * (lr - lc)).sum(dim=-1, dtype=torch.float64))
    return torch.cat(out)


def check_vocab(engine, vocab_size: int, name: str) -> None:
    if engine.model_config.vocab_size != vocab_size:
        raise ValueError(f"{name}: vocabulary of {engine.model_config.vocab_size} tokens, the reference has "
                         f"{vocab_size}; logits can only be compared over the same vocabulary")
