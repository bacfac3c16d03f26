"""Pass/fail thresholds for `quant-serve eval`, read from TOML. A key left out disables that check.

  max_ppl_increase_pct = 5.0   # perplexity may rise at most this many percent over the reference
  max_kld = 0.15               # mean KL divergence from the reference, nats per token
  min_top1 = 0.80              # top-1 agreement with the reference, fraction
  max_task_drop = 0.05         # accuracy may fall at most this much below the reference's on any task, fraction

  [kv_cache]                   # optional: overrides for candidates that differ from the reference only in KV dtype
  max_ppl_increase_pct = 0.5

  [activations]                # optional: overrides for candidates that differ only in the activation path
  max_ppl_increase_pct = 0.2   # (the reference's own weights with int8 activations against its fp16 path)
"""
from dataclasses import dataclass, field, fields
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:        # Python 3.10: the same parser from PyPI (the eval extra installs it)
    import tomli as tomllib

DEFAULT_GATE = Path(__file__).parent / "default_gate.toml"
FRACTION_KEYS = ("min_top1", "max_task_drop")


@dataclass
class Thresholds:
    max_ppl_increase_pct: float | None = None
    max_kld: float | None = None
    min_top1: float | None = None
    max_task_drop: float | None = None


@dataclass
class Gate:
    weights: Thresholds
    kv_cache: Thresholds
    source: str
    activations: Thresholds = field(default_factory=Thresholds)


@dataclass
class Failure:
    candidate: str
    check: str
    value: float
    limit: float
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.candidate}: {self.check} = {self.value:.4g} (limit {self.limit:.4g}){self.detail}"


@dataclass
class GateResult:
    failed: list[Failure] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)   # "candidate: check" for every check that ran

    @property
    def passed(self) -> bool:
        return not self.failed

    def to_json(self) -> dict:
        return {"passed": self.passed, "checked": self.checked,
                "failed": [{"candidate": f.candidate, "check": f.check, "value": f.value, "limit": f.limit,
                            "message": str(f)} for f in self.failed]}


def _thresholds(table: dict, where: str, base: Thresholds | None = None) -> Thresholds:
    known = {f.name for f in fields(Thresholds)}
    values = dict(vars(base)) if base else {}
    for key, value in table.items():
        if key not in known:
            raise ValueError(f"{where}: unknown gate key {key!r} (known: {', '.join(sorted(known))}, [kv_cache], "
                             "[activations])")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: {key} must be a number, got {value!r}")
        if key in FRACTION_KEYS and not 0 <= value <= 1:
            raise ValueError(f"{where}: {key} is a fraction in [0, 1], got {value}")
        values[key] = float(value)
    return Thresholds(**values)


def load_gate(path: str | Path | None = None) -> Gate:
    path = Path(path) if path else DEFAULT_GATE
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"gate file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML: {e}") from e
    kv_table, act_table = data.pop("kv_cache", {}), data.pop("activations", {})
    for name, table in (("kv_cache", kv_table), ("activations", act_table)):
        if not isinstance(table, dict):
            raise ValueError(f"{path}: {name} must be a table")
    weights = _thresholds(data, str(path))
    return Gate(weights, _thresholds(kv_table, f"{path} [kv_cache]", weights), str(path),
                _thresholds(act_table, f"{path} [activations]", weights))


def check_gate(gate: Gate, summary: dict) -> GateResult:
    """summary: the machine-readable report (report.summary_json). Each candidate is checked against its limits."""
    result = GateResult()
    ref_tasks = summary["reference"].get("tasks", {})
    for cand in summary["candidates"]:
        limits = gate.kv_cache if cand.get("kv_only") else gate.activations if cand.get("act_only") else gate.weights
        name = cand["name"]

        def check(label: str, value: float, limit: float | None, too_high: bool, detail: str = "") -> None:
            if limit is None:
                return
            result.checked.append(f"{name}: {label}")
            if (value > limit) if too_high else (value < limit):
                result.failed.append(Failure(name, label, value, limit, detail))

        check("ppl_increase_pct", cand["ppl_change_pct"], limits.max_ppl_increase_pct, True)
        check("kld", cand["kld"], limits.max_kld, True)
        check("top1", cand["top1"], limits.min_top1, False)
        for task, res in cand.get("tasks", {}).items():
            if task in ref_tasks:
                drop = ref_tasks[task]["accuracy"] - res["accuracy"]
                check(f"task_drop[{task}]", drop, limits.max_task_drop, True,
                      f" ({ref_tasks[task]['accuracy']:.3f} -> {res['accuracy']:.3f})")
    return result
