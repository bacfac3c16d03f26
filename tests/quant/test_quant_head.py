"""--quantize-lm-head: an INT4 g128 round-to-nearest head at load, the memory plan that counts it, and eval's
candidates with and without it."""
import torch

from quant_serve.engine.config import HEAD_GROUP_SIZE
from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.engine.plan.memory import plan_memory
from quant_serve.eval.harness import EvalConfig, plan_candidates
from helpers import make_engine
from quant_serve.quant.layers.dense import DenseLinear
from quant_serve.quant.layers.linear import QuantLinear
from quant_serve.quant.rtn import dequantize_codes, quantize_rtn
from quant_serve.server.cli.main import build_parser

from conftest import QWEN_7B


def test_int4_head_is_the_rtn_of_the_tied_table_and_scores_as_its_dequantized_weights(heldout_text):
    fp_head, int4_head = make_engine(DEMO_MODEL_DIR), make_engine(DEMO_MODEL_DIR, quantize_lm_head=True)
    head = int4_head.model.lm_head
    assert fp_head.model.lm_head is None and isinstance(head, QuantLinear)        # tied: the table stays
    table = int4_head.model.model.embed_tokens.weight
    assert torch.equal(table, fp_head.model.model.embed_tokens.weight)
    q, s, z = quantize_rtn(table.float(), 4, HEAD_GROUP_SIZE, False, scale_dtype=torch.float16)
    rtn = dequantize_codes(q, s.half().float(), z, HEAD_GROUP_SIZE)
    assert torch.equal(head.dequantized_weight(), rtn)
    ids = fp_head.tokenizer.encode(heldout_text[:4000])[:300]
    ref = fp_head.score(ids)
    dense = DenseLinear(table.shape[1], [table.shape[0]], False, torch.float32)
    dense.weight.data.copy_(rtn)
    fp_head.model.lm_head = dense                                                  # the same head, dequantized
    torch.testing.assert_close(int4_head.score(ids), fp_head.score(ids), atol=1e-4, rtol=1e-4)
    logp, logq = ref.log_softmax(-1), int4_head.score(ids).log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean().item()
    assert 0 < kl < 0.03                   # measured 0.0105 on this model; a wrong packing gives several nats


def test_plan_counts_the_int4_head():
    qwen = QWEN_7B
    v, h = 152064, 3584
    int4 = h * v // 2 + (h // 128) * v * 2 + (h // 128) * v // 2             # codes, fp16 scales, packed zeros
    base, quantized = plan_memory(qwen), plan_memory(qwen, int4_head=True)
    assert base.weights_bytes - quantized.weights_bytes == v * h * 2 - int4     # untied: replaces the FP16 head
    assert quantized.kv_cache_tokens > base.kv_cache_tokens
    tied = DEMO_MODEL_DIR                                                       # the tiny model: a tied head
    assert (plan_memory(tied, int4_head=True).weights_bytes - plan_memory(tied).weights_bytes
            == 512 * 8192 // 2 + 4 * 8192 * 2 + 4 * 8192 // 2)                   # tied: an extra copy
    args = build_parser().parse_args(["plan", str(qwen), "--quantize-lm-head"])
    assert args.quantize_lm_head
    serve = build_parser().parse_args(["serve", "--quantize-lm-head"])
    assert serve.quantize_lm_head


def test_eval_adds_each_model_with_the_int4_head():
    cfg = EvalConfig(reference="ref", models=["a/awq", "b/awq"], quantize_lm_head=True, kv_cache_dtype="fp8")
    got = [(c.name, c.model_dir, c.int4_head, c.kv_only) for c in plan_candidates(cfg)]
    assert got == [("awq", "a/awq", False, False), ("awq +int4 head", "a/awq", True, False),
                   ("awq#2", "b/awq", False, False), ("awq#2 +int4 head", "b/awq", True, False),
                   ("ref kv=fp8_e4m3", "ref", False, True)]
