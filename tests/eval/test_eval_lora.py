"""`quant-serve eval --lora PATH` (issue #55): every model of the comparison runs under the adapter, the reference
too, so the report is base + adapter against FP16 base + adapter: the trained fixture in FP16 and the INT4 demo
model (AutoAWQ-format quantization of the same weights) under the `upper` test adapter."""
import pytest

from conftest import TESTS
from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.eval.harness import EvalConfig, adapter_rank, run_eval

UPPER = TESTS / "data" / "lora" / "upper"


def _run(trained_model, heldout_text, tmp_path, lora):
    data = tmp_path / "heldout.txt"
    data.write_text(heldout_text)
    return run_eval(EvalConfig(reference=str(trained_model), models=[str(DEMO_MODEL_DIR)], data=[str(data)],
                               tasks=[], max_tokens=600, layer_windows=1,
                               device="cpu", dtype="float32", lora=lora))


def test_eval_under_an_adapter(trained_model, heldout_text, tmp_path):
    base = _run(trained_model, heldout_text, tmp_path, None)
    adapted = _run(trained_model, heldout_text, tmp_path, str(UPPER))
    # the adapter is applied to the reference and to the candidate: both distributions move
    ref_base, ref_lora = base.reference.stats.summary(), adapted.reference.stats.summary()
    cand_base, cand_lora = base.candidates[0].stats.summary(), adapted.candidates[0].stats.summary()
    assert abs(ref_lora["perplexity"] / ref_base["perplexity"] - 1) > 1e-3
    assert abs(cand_lora["perplexity"] / cand_base["perplexity"] - 1) > 1e-3
    # INT4 + adapter against FP16 + adapter stays as close as INT4 against FP16 without it
    assert 0 < cand_lora["kld"] < 2 * cand_base["kld"] and cand_lora["top1"] > 0.8
    assert adapted.candidates[0].layers == [] and base.candidates[0].layers      # no per-layer error under it


def test_adapter_rank_and_a_missing_adapter(tmp_path):
    assert adapter_rank(str(UPPER)) == 8
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        adapter_rank(str(tmp_path))
