"""Acceptance of proposed tokens against the target model's distributions at the k + 1 verified positions.

Greedy: accept while a proposal equals the target's argmax, then the target's own token at the first mismatch (or
after the last proposal: the bonus token). Random: the standard speculative-sampling rule (Leviathan et al., Chen
et al.): accept proposal d with probability min(1, p(d) / q(d)); at the first rejection draw from
normalize(max(p - q, 0)); when all k are accepted draw the bonus from p at position k. Every emitted token is then
distributed exactly as the target's p. A proposer without a distribution (prompt lookup, a greedy draft) is a point
mass q = onehot(d): accept with probability p(d), resample from p with d removed.
"""
import torch


def accept_greedy(target_argmax: list[int], draft: list[int]) -> list[int]:
    """target_argmax: k + 1 argmax tokens; draft: k proposals. -> the emitted tokens (1 .. k + 1)."""
    assert len(target_argmax) == len(draft) + 1, (len(target_argmax), len(draft))
    out = []
    for proposed, target in zip(draft, target_argmax):
        out.append(target)
        if proposed != target:
            return out
    out.append(target_argmax[-1])
    return out


def accept_sampled(target_probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                   generator: torch.Generator | None) -> list[int]:
    """target_probs: [k + 1, V] the target's (temperature, top-k/p filtered) probabilities at the verified positions;
    draft: k proposals; draft_probs: [k, V] the proposer's probabilities, or None for a point mass at each proposal.
    -> the emitted tokens (1 .. k + 1)."""
    k = len(draft)
    assert target_probs.dim() == 2 and target_probs.shape[0] == k + 1, (tuple(target_probs.shape), k)
    device = target_probs.device
    if k:
        idx = torch.tensor(draft, dtype=torch.long, device=device)
        p = target_probs[:k].gather(1, idx[:, None])[:, 0]                                    # [k]
        q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(1, idx[:, None])[:, 0]
        u = torch.rand(k, generator=generator, device=device, dtype=p.dtype)
        # u < p / q without dividing (q > 0 for every proposal its proposer could make)
        accepted = (u * q < p).tolist()
    else:
        accepted = []
    num = next((j for j, ok in enumerate(accepted) if not ok), k)
    if num == k:
        residual = target_probs[k]                                                            # [V]
    else:
        q_row = torch.zeros_like(target_probs[num]) if draft_probs is None else draft_probs[num].to(target_probs.dtype)
        if draft_probs is None:
            q_row[draft[num]] = 1.0
        residual = (target_probs[num] - q_row).clamp_min(0)
        if float(residual.sum()) <= 0:          # p == q (rejection had probability 0): p itself is the residual
            residual = target_probs[num]
    last = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return list(draft[:num]) + [last]
