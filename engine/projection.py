"""Decode speed on a card we do not have, projected from what was measured on the H200 under that card's profile.

A decode step reads every weight once (the embedding table only where the head is tied to it) and each sequence's
KV cache; on the cards our users own it is bound by that traffic. The projection is

    tok/s = batch x efficiency x card bandwidth / bytes a step reads,

where `efficiency` (achieved bytes/s over the H200's datasheet bandwidth, as the card's datasheet bandwidth is what
the projection scales) comes from bench/e2e.py run on the H200 under the card's kernel profile (kernels/gpu.py: its plan, its SM count, no TMA / wgmma / PDL where it has none).
It is a projection, not a measurement: the efficiency of a slower card's memory may differ from the H200's.
"""
from dataclasses import dataclass

from quant_serve.engine.memory import MemoryPlan
from quant_serve.kernels.gpu import GPUCaps

PROJECTION_CONTEXT = 1024      # tokens of context a sequence holds in the projection


@dataclass(frozen=True)
class Efficiency:
    """Achieved decode bytes/s over copy bandwidth, measured on the H200 under a family's profile."""
    batch1: float
    batch32: float
    source: str


# Qwen2.5-7B AWQ g128, fp8 KV, 24 GiB cap; batch 1: 128-token prompt, 256 generated; batch 32: 32 x 128/256 (a
# sequence holds 256 tokens on average). tests/test_projection.py recomputes these from the JSON files.
H200_GBS = 4800.0
E2E_MEAN_CONTEXT = 128 + 256 // 2
MEASURED = {
    "sm86": Efficiency(0.4914, 0.2767, "bench/results/e2e-sm86-profile-h200.json (a10 profile)"),
    "sm90": Efficiency(0.5537, 0.3476, "bench/results/e2e-qwen-fp8-h200.json (native)"),
}
# sm89 (RTX 4090, L4) runs the sm86 plan with hardware fp8 conversion and sm80 (A100) the same plan; neither was
# run under its own profile: they take the sm86 figures.
DERIVED = {"sm89": "sm86", "sm80": "sm86"}


def efficiency_of_run(run: dict, kv_bytes_per_token: int) -> tuple[float, float]:
    """(batch 1, batch 32) efficiency of one bench/e2e.py run (its "runs" entry): achieved bytes/s over H200_GBS."""
    weights = run["decode_bytes_per_step"]
    batch1 = run["batch1_tok_s"] * weights
    batch32 = run["batch32_tok_s"] / 32 * (weights + 32 * E2E_MEAN_CONTEXT * kv_bytes_per_token)
    return batch1 / (H200_GBS * 1e9), batch32 / (H200_GBS * 1e9)


def efficiency_for(caps: GPUCaps) -> tuple[Efficiency, str]:
    family = caps.family
    if family in MEASURED:
        return MEASURED[family], "measured"
    return MEASURED[DERIVED.get(family, "sm86")], f"derived from {DERIVED.get(family, 'sm86')}"


def step_bytes(plan: MemoryPlan, batch: int, context: int) -> int:
    """Bytes one decode step of `batch` sequences of `context` tokens reads: the weights (the embedding table only
    when it is the head) and the sequences' KV cache."""
    weights = plan.weights_bytes - (0 if plan.tied_embeddings else plan.embedding_bytes)
    return weights + batch * context * plan.kv_bytes_per_token


def project_decode(plan: MemoryPlan, caps: GPUCaps, context: int = PROJECTION_CONTEXT) -> dict:
    """Projected decode tok/s at batch 1 and 32 on the card of `caps`."""
    eff, how = efficiency_for(caps)
    out = {"gpu": caps.name, "bandwidth_gbs": caps.bandwidth_gbs, "context": context, "efficiency": how,
           "source": eff.source}
    for batch, e in ((1, eff.batch1), (32, eff.batch32)):
        out[f"batch{batch}_tok_s"] = batch * e * caps.bandwidth_gbs * 1e9 / step_bytes(plan, batch, context)
    return out
