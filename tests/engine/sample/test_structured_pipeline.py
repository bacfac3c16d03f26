"""Issue 54, parts 2-3: constrained decoding off the critical path and forced tokens, with the same greedy outputs.
The demo model's greedy tokens under seven constraints (a schema with free text, the bench's schema, a schema of
mostly fixed keys, a regex, a choice, any JSON object, none), recorded on main at 3205078 before these changes
(every token sampled, one forward each), must come out the same: with async scheduling (the masks begun in a worker
thread, the sampling behind the next step's preparation) and forced tokens appended without a forward each
(jump-forward, their KV computed as a chunk by the next step), and synchronously with every token sampled."""
import pytest

from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.sample.structured_mask import GrammarMasks
from quant_serve.server.cli.bench_offline import BENCH_JSON_SCHEMA

from helpers import assert_all_blocks_free, make_engine

FREE = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 16}, "count": {"type": "integer"},
                                         "kind": {"enum": ["noun", "verb"]}}, "required": ["word", "count", "kind"]}
FIXED = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "status": {"enum": ["active", "inactive"]},
    "flags": {"type": "object", "properties": {"visible": {"type": "boolean"}, "archived": {"type": "boolean"}},
              "required": ["visible", "archived"]}}, "required": ["name", "status", "flags"]}
CONSTRAINTS = [{"json": FREE}, {"json": BENCH_JSON_SCHEMA}, {"json": FIXED}, {"regex": "[a-z]{3,9}( [a-z]{2,6})*"},
               {"choice": ["yes", "no", "it depends"]}, {"json_object": True}, None]
PROMPTS = ['<|im_start|>user\nWhat does "harbor" mean? Answer in JSON.<|im_end|>\n<|im_start|>assistant\n',
           "The list of items:", "A user record:", "Describe the sea", "Is it good?", "JSON:", "Once upon a time"]
BEFORE = [
    [93, 4, 1085, 5368, 355, 95, 4, 14, 355, 1994, 5368, 452, 14, 355, 6470, 5368, 355, 88, 264, 68, 4, 95, 2],
    [93, 4, 2791, 5368, 1176, 63, 95, 2],
    [93, 4, 1035, 5368, 355, 35, 4, 14, 355, 268, 1924, 5368, 355, 67, 316, 451, 1318, 355, 4602, 5368, 2004, 4,
     4312, 848, 5368, 223, 72, 1266, 14, 355, 1400, 1662, 5368, 223, 72, 1266, 95, 95, 2],
    [1695, 359, 276, 1698, 285, 276, 2002, 325, 276, 4628, 472, 276, 2717, 325, 276, 4628, 472, 276, 2717, 325,
     276, 4628, 472, 276, 2717, 325, 276, 4628, 472, 276, 2717, 325, 276, 4628, 472, 276, 2717, 325, 276, 4628],
    [80, 81, 2],
    [93, 95, 2],
    [14, 276, 863, 347, 276, 201, 259, 361, 69, 28, 613, 356, 781, 1936, 65, 85, 367, 66, 590, 16, 201, 201, 259,
     536, 1418, 431, 509, 16, 21, 201, 201, 201, 395, 278, 28, 1521, 431, 4307, 991, 1936]
]


def _generate(engine) -> list[list[int]]:
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=c) for c in CONSTRAINTS]
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)]


@pytest.mark.parametrize("async_scheduling, forced", [(True, 32), (False, 0)], ids=["async-forced", "sync"])
def test_constrained_greedy_outputs_are_those_before(async_scheduling, forced):
    engine = make_engine(DEMO_MODEL_DIR, async_scheduling=async_scheduling, max_num_seqs=16,
                         structured_forced_tokens=forced)
    waits = []
    if async_scheduling:        # the masks were begun ahead: the sampler only waited for them
        wait = GrammarMasks.wait
        engine.runner.sampler.grammars.wait = lambda future: waits.append(1) or wait(engine.runner.sampler.grammars,
                                                                                      future)
    assert _generate(engine) == BEFORE
    assert (len(waits) >= 30) == async_scheduling, len(waits)
    # the fixed-key schema's keys and the bench schema's opening: 41 of the 156 tokens forced, none when off
    assert engine.stats.structured_forced_tokens_total == (41 if forced else 0)
    assert engine.stats.generation_tokens_total == 156
    assert_all_blocks_free(engine)


def test_bench_compares_each_schema_with_the_unconstrained_load():
    """`bench offline --structured-outputs json-schema --compare-unconstrained`: per schema its ratio, and forced
    tokens counted where the grammar forces them."""
    from quant_serve.server.cli.bench_offline import compare_structured
    engine = make_engine(DEMO_MODEL_DIR, max_model_len=128)
    result = compare_structured(engine, ["free-text", "fixed-keys"], num_prompts=2, input_len=8, output_len=12,
                                range_ratio=0.0, seed=0)
    assert set(result["constrained_over_unconstrained_by_schema"]) == {"free-text", "fixed-keys"}
    assert result["constrained_over_unconstrained"] == result["schemas"]["free-text"]["constrained_over_unconstrained"]
    assert len(result["rounds"]) == 2 and result["schemas"]["fixed-keys"]["output_tok_s"] > 0
    assert result["schemas"]["fixed-keys"]["engine_stats_delta"]["structured_forced_tokens_total"] > 0
    assert_all_blocks_free(engine)
