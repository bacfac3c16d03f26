"""`quant-serve plan --gpu`: the projected decode speed rests on the efficiencies measured on the H200 (recomputed
here from the committed bench JSON) and scales with the card's bandwidth and the bytes a step reads."""
import json

import pytest

from quant_serve.engine.memory import plan_memory
from quant_serve.engine.projection import (E2E_MEAN_CONTEXT, MEASURED, efficiency_of_run, project_decode,
                                            step_bytes)
from quant_serve.kernels.gpu import PROFILES

from conftest import REPO, SHARED

QWEN = SHARED / "configs" / "qwen2.5-7b-instruct"
QWEN_FP8_KV_BYTES = 2 * 28 * 4 * 128          # per token: K and V, 28 layers, 4 kv heads, head_dim 128, 1 byte


@pytest.mark.parametrize("family,path", [("sm86", "e2e-sm86-profile-h200.json"), ("sm90", "e2e-qwen-fp8-h200.json")])
def test_efficiencies_are_the_measured_ones(family, path):
    run = json.loads((REPO / "bench" / "results" / path).read_text())["runs"]["qwen2.5-7b-awq/fp8"]
    batch1, batch32 = efficiency_of_run(run, QWEN_FP8_KV_BYTES)
    assert MEASURED[family].batch1 == pytest.approx(batch1, abs=1e-4)
    assert MEASURED[family].batch32 == pytest.approx(batch32, abs=1e-4)


def test_projection_scales_with_bandwidth_and_reproduces_the_h200_run():
    plan = plan_memory(QWEN, gpu_mem_gb=24.0, kv_cache_dtype="fp8", max_model_len=4096)
    assert plan.kv_bytes_per_token == QWEN_FP8_KV_BYTES
    a10, gpu3090, h200 = (project_decode(plan, PROFILES[g]) for g in ("a10", "3090", "h200"))
    assert a10["batch1_tok_s"] * 936 / 600 == pytest.approx(gpu3090["batch1_tok_s"])   # same family: bandwidth
    assert a10["efficiency"] == "measured" and project_decode(plan, PROFILES["4090"])["efficiency"].startswith("derived")
    # the H200's own batch-1 run, at its context, is what the projection gives back (within the step's bytes
    # counted from the plan instead of the loaded model: < 1%)
    runs = json.loads((REPO / "bench" / "results" / "e2e-qwen-fp8-h200.json").read_text())["runs"]
    run = runs["qwen2.5-7b-awq/fp8"]
    assert step_bytes(plan, 1, 0) == pytest.approx(run["decode_bytes_per_step"], rel=0.01)
    assert project_decode(plan, PROFILES["h200"], context=0)["batch1_tok_s"] == pytest.approx(run["batch1_tok_s"],
                                                                                              rel=0.01)
    at_run = project_decode(plan, PROFILES["h200"], context=E2E_MEAN_CONTEXT)
    assert at_run["batch32_tok_s"] == pytest.approx(run["batch32_tok_s"], rel=0.01)
    assert h200["batch32_tok_s"] < at_run["batch32_tok_s"]          # 1,024-token contexts read more KV a step
