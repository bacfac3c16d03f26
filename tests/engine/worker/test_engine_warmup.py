"""ModelRunner.warmup (run at engine start on CUDA so that kernel compilation does not land in the first requests):
it must leave no trace: the KV cache untouched, the fp8 scale calibration still pending, outputs unchanged."""
import torch

from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.worker.warmup import warm_up

from helpers import assert_all_blocks_free, make_engine

PROMPTS = ["The meaning of the word", 'What does "harbor" mean?']


def test_warmup_leaves_cache_calibration_and_outputs_unchanged():
    cold = make_engine(DEMO_MODEL_DIR, kv_cache_dtype="fp8", chunk=96, max_num_seqs=8, max_model_len=256)
    warm = make_engine(DEMO_MODEL_DIR, kv_cache_dtype="fp8", chunk=96, max_num_seqs=8, max_model_len=256)
    caches = [c.clone() for c in warm.runner.k_caches + warm.runner.v_caches]
    observer = warm.runner._first_forward_observer
    assert observer is not None                       # fp8 without checkpoint scales: calibrated by the first step
    forwards = warm_up(warm.runner, 96, 8, 256)
    assert forwards >= 10
    assert all(torch.equal(a, b) for a, b in zip(caches, warm.runner.k_caches + warm.runner.v_caches))
    assert warm.runner._first_forward_observer is observer
    params = SamplingParams(max_tokens=12, temperature=0)
    expected = [o.outputs[0].token_ids for o in cold.generate(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in warm.generate(PROMPTS, params)] == expected
    assert [a.k_scale.item() for a in warm.model.attention_layers] == \
        [a.k_scale.item() for a in cold.model.attention_layers]
    assert_all_blocks_free(warm)
