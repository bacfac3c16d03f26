"""Fit the card model's constants (engine/card_model.py) to measured runs.

Each run is an `Observation`: the kernels it launched (engine/card_step.py: a layer's matmul at some M, a decode
attention call, or a whole engine step), the GPU it ran on, the kernel plan (profile) it ran under, and the measured
seconds. The model predicts every observation from the GPU's datasheet rates (kernels/gpu.py) and the constants

    eta_mem, eta_tc[fp16_f32acc], launch_us, small_us, step_us, sm_bytes[family], sm_ops[tile]

and the fit minimises the sum of squared log errors log(predicted / measured), each observation weighted (whole
steps, what `plan --gpu` projects, weigh more than single kernels). The constants live in a box (an efficiency in
0.3..1, a launch in 0..20 us, bytes per SM-clock in 1..64, ...); the search is Levenberg-Marquardt on their
logarithms, clipped to the box, with a forward-difference Jacobian: the model is a max of terms, smooth piece by
piece, and a dozen constants against a few hundred observations converge in tens of iterations. A constant no
observation moves (a family with no data) stays where it started, and `fit` reports it as not fitted.

Why two GPUs: the H100 and the H200 have the same SMs, clock and tensor rates but 3.35 / 4.8 TB/s. A kernel that is
as fast on both is bound by its SMs or its launch; one that scales with bandwidth is bound by DRAM. On one GPU,
eta_mem and the SM terms trade against each other; `fixed` pins constants a profile's data cannot separate (the
sm86 plan was measured on the H200 only: its eta_mem and eta_tc come from the sm90 fit).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from quant_serve.engine.card_model import DTYPES, CardParams, sm_ops_key, tensor_rate
from quant_serve.engine.card_step import Kernel
from quant_serve.kernels.gpu import PROFILES, resolve_caps


@dataclass(frozen=True)
class Observation:
    label: str
    gpu: str                      # PROFILES key of the GPU it ran on: h100, h200
    profile: str                  # the kernel plan it ran under: "this" or a PROFILES key
    kernels: tuple[Kernel, ...]   # the launches of one repetition
    steps: int                    # engine steps in it (each adds step_us): 0 for a kernel benchmark
    seconds: float                # measured
    source: str                   # file and commit
    weight: float = 1.0

    @property
    def kind(self) -> str:
        return "step" if self.steps else "kernel"


def plan_caps(gpu: str, profile: str):
    """The caps the kernel plan saw: the GPU's own or the profile's (kernels/gpu.py resolve_caps)."""
    return resolve_caps(PROFILES[gpu], profile)


# eta_mem stops at 0.95: the copy kernel reaches 0.89-0.90 of the datasheet on both GPUs (read + write; bench/
# results e2e-*.json copy_bandwidth_bytes_s), read-only streams a little more, no DRAM its datasheet rate.
BOUNDS = {"eta_mem": (0.3, 0.95), "eta_tc": (0.2, 1.0), "launch_us": (0.0, 20.0), "small_us": (0.0, 20.0),
          "step_us": (0.0, 2000.0), "sm_bytes": (1.0, 64.0), "sm_ops": (64.0, 16384.0)}


def _names(p: CardParams) -> list[tuple[str, str]]:
    return ([("eta_mem", ""), ("eta_tc", "fp16_f32acc"), ("launch_us", ""), ("small_us", ""), ("step_us", "")]
            + [("sm_bytes", f) for f in sorted(p.sm_bytes)] + [("sm_ops", f) for f in sorted(p.sm_ops)])


def _get(p: CardParams, name: str, key: str) -> float:
    value = getattr(p, name)
    return value[key] if key else value


def _with(p: CardParams, values: dict) -> CardParams:
    out = {}
    for (name, key), v in values.items():
        if key:
            out[name] = {**out.get(name, getattr(p, name)), key: v}
        else:
            out[name] = v
    if "eta_tc" in out:       # int8 / fp8 have no kernels to fit yet: they take the FP16 efficiency
        out["eta_tc"] = {d: out["eta_tc"].get("fp16_f32acc") for d in DTYPES}
    return replace(p, **out)


class _Table:
    """The observations' kernels as arrays, so that predicting all of them is a few numpy operations."""

    def __init__(self, obs: list[Observation], families: list[str], tiles: list[str]):
        rows = []
        for i, o in enumerate(obs):
            hw, plan = PROFILES[o.gpu], plan_caps(o.gpu, o.profile)
            for k in o.kernels:
                sms = plan.sms if k.grid_sized else hw.sms
                clock = sms * hw.boost_mhz * 1e6
                rate = tensor_rate(hw, k.dtype) if k.dtype else 0.0
                rows.append((i, k.nbytes / (hw.bandwidth_gbs * 1e9), k.nbytes / clock, k.ops / clock,
                             k.ops / rate if rate else 0.0, families.index(k.family) if k.family in families else -1,
                             tiles.index(sm_ops_key(k, tiles)) if sm_ops_key(k, tiles) else -1,
                             k.family == "small"))
        a = np.array(rows, dtype=float)
        self.obs, self.dram, self.smb, self.smo, self.tc = a[:, 0].astype(int), a[:, 1], a[:, 2], a[:, 3], a[:, 4]
        self.fam, self.tile, self.tiles = a[:, 5].astype(int), a[:, 6].astype(int), tiles
        self.small = a[:, 7] > 0
        self.n = len(obs)
        self.steps = np.array([o.steps for o in obs], dtype=float)
        self.measured = np.array([o.seconds for o in obs])
        self.weight = np.sqrt(np.array([o.weight for o in obs]))

    def predict(self, p: CardParams, families: list[str]) -> np.ndarray:
        inv_b = np.array([1 / p.sm_bytes[f] if f in p.sm_bytes else 0.0 for f in families] + [0.0])
        inv_o = np.array([1 / p.sm_ops[t] if t in p.sm_ops else 0.0 for t in self.tiles] + [0.0])
        fixed = np.where(self.small, p.small_us, p.launch_us) * 1e-6
        t = np.maximum.reduce([self.dram / p.eta_mem, self.smb * inv_b[self.fam], self.smo * inv_o[self.tile],
                               self.tc / p.eta_tc["fp16_f32acc"]]) + fixed
        return np.bincount(self.obs, weights=t, minlength=self.n) + self.steps * p.step_us * 1e-6


def predict(obs: list[Observation], p: CardParams) -> np.ndarray:
    families = sorted({k.family for o in obs for k in o.kernels})
    return _Table(obs, families, sorted(p.sm_ops)).predict(p, families)


def fit(obs: list[Observation], start: CardParams, fixed: tuple[str, ...] = (), iterations: int = 200
        ) -> tuple[CardParams, dict]:
    """Least squares of the weighted log errors over the constants of `start` not named in `fixed` (names as in
    CardParams, or "sm_bytes:attn" for one family). -> (fitted params, report: rms / worst log error, which
    constants were fitted and which no observation moved)."""
    families = sorted({k.family for o in obs for k in o.kernels})
    table = _Table(obs, families, sorted(start.sm_ops))
    free = [(n, k) for n, k in _names(start) if n not in fixed and f"{n}:{k}" not in fixed]
    lo = np.array([math.log(max(BOUNDS[n][0], 1e-3)) for n, _ in free])
    hi = np.array([math.log(BOUNDS[n][1]) for n, _ in free])

    def params(u):
        return _with(start, {name: math.exp(v) for name, v in zip(free, u)})

    def residuals(u):
        return table.weight * np.log(table.predict(params(u), families) / table.measured)

    u = np.clip(np.array([math.log(max(_get(start, n, k), 1e-3)) for n, k in free]), lo, hi)
    r = residuals(u)
    cost, damping = float(r @ r), 1e-3
    for _ in range(iterations):
        jac = np.empty((len(r), len(u)))
        for j in range(len(u)):                  # forward differences, backward at the upper bound
            step = np.zeros_like(u)
            step[j] = 1e-5 if u[j] + 1e-5 <= hi[j] else -1e-5
            jac[:, j] = (residuals(u + step) - r) / step[j]
        jtj, grad = jac.T @ jac, jac.T @ r
        improved = False
        while damping < 1e8:
            delta = np.linalg.solve(jtj + damping * np.diag(np.diag(jtj) + 1e-12), -grad)
            trial = np.clip(u + np.clip(delta, -1.0, 1.0), lo, hi)     # at most a factor e a step
            r_trial = residuals(trial)
            if float(r_trial @ r_trial) < cost:
                u, r, cost, damping, improved = trial, r_trial, float(r_trial @ r_trial), damping / 3, True
                break
            damping *= 4
        if not improved or cost < 1e-12:
            break
    moved = [f"{n}:{k}" if k else n for (n, k), col in zip(free, jac.T) if np.abs(col).max() > 1e-9]
    errors = table.predict(params(u), families) / table.measured - 1
    return params(u), {"rms_error": float(np.sqrt(np.mean(errors ** 2))), "worst_error": float(np.abs(errors).max()),
                       "fitted": moved, "not_fitted": [f"{n}:{k}" if k else n for n, k in free
                                                       if (f"{n}:{k}" if k else n) not in moved]}
