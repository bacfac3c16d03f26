"""A decode step's inputs on their way to the CUDA graphs (engine/worker/cuda_graph.py): one packed buffer that the graphs
read through views of one device blob, and the carried-token gather (kernels/step_inputs.py). On CPU the graphs are
stood in for by eager forwards over the same views, so the packing, the padding rows and the gather are checked
end to end against the engine without graphs."""
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernel module is imported (decoration time)

from quant_serve.engine.worker.cuda_graph import GREEDY_MAX_BATCH, DecodeGraphs, DecodeInputs  # noqa: E402
from quant_serve.engine.load.demo import DEMO_MODEL_DIR  # noqa: E402
from quant_serve.engine.sampling_params import SamplingParams  # noqa: E402
from quant_serve.kernels.interpret import patch_triton_interpreter  # noqa: E402
from quant_serve.kernels.step_inputs import take_carried, take_carried_ref, take_carried_triton  # noqa: E402

from helpers import assert_all_blocks_free, make_engine  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
patch_triton_interpreter()


def test_packed_inputs_read_back_through_the_device_views():
    layout = DecodeInputs(max_batch=8, max_blocks=5)
    packed = layout.pack(4, 3, ids=[11, 0, 13], positions=[40, 7, 33], slots=[640, 119, 530], seq_lens=[41, 8, 34],
                         tables=[[2, 9, 4], [7], [1, 6, 3]], carry_rows=[-1, 2, -1])
    assert packed.dtype == np.uint8 and packed.size == layout.table_offset + 4 * 4 * 3
    blob = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)
    blob[:packed.size] = torch.from_numpy(packed)
    ids, positions, slots, carry_rows, seq_lens, tables = layout.views(blob)
    assert ids[:4].tolist() == [11, 0, 13, 0] and positions[:4].tolist() == [40, 7, 33, 0]
    assert slots[:4].tolist() == [640, 119, 530, -1]                 # the padding row stores nothing
    assert carry_rows[:4].tolist() == [-1, 2, -1, -1] and seq_lens[:4].tolist() == [41, 8, 34, 1]
    assert tables[:12].view(4, 3).tolist() == [[2, 9, 4], [7, 0, 0], [1, 6, 3], [0, 0, 0]]
    assert ids.dtype == torch.int64 and seq_lens.dtype == torch.int32 and tables.numel() == 8 * 5


@pytest.mark.parametrize("n", [1, 5, 17])
def test_take_carried_matches_twin(n):
    gen = torch.Generator().manual_seed(n)
    tokens = torch.randint(0, 50_000, (n + 3,), generator=gen)
    rows = torch.randint(-1, n + 3, (n,), generator=gen)
    ids = torch.randint(0, 50_000, (n,), generator=gen)
    want = ids.clone()
    take_carried_ref(want, rows, tokens)
    got = ids.to(DEV)
    take_carried_triton(got, rows.to(DEV), tokens.to(DEV))
    assert torch.equal(got.cpu(), want)
    assert torch.equal(want[rows < 0], ids[rows < 0]) and torch.equal(want[rows >= 0], tokens[rows[rows >= 0]])
    cpu = ids.clone()
    take_carried(cpu, rows, tokens)                  # on CPU: the twin
    assert torch.equal(cpu, want)


@pytest.mark.parametrize("vocab", [7, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_argmax_rows_matches_torch_ties_included(vocab, dtype, monkeypatch):
    import quant_serve.kernels.argmax as argmax
    if DEV == "cpu":
        monkeypatch.setattr(argmax, "CHUNK", 64)         # several chunks a row in the interpreter too
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=gen).to(dtype)
    logits[1, vocab // 2] = logits[1, vocab - 1] = 9.0    # a tie across chunks: the first index wins
    logits[2] = 1.0                                       # all equal: index 0
    logits[3, : vocab // 3] = float("-inf")
    logits[3, vocab - 1] = float("nan")                  # NaN ranks first (the last chunk's padding must not win)
    got = argmax.argmax_rows_triton(logits.to(DEV))
    assert got.dtype == torch.int64 and got.cpu().tolist() == logits.argmax(dim=-1).tolist()
    assert got.cpu()[1] == vocab // 2 and got.cpu()[2] == 0
    assert argmax.argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist()     # CPU: torch


class EagerGraph:
    """Stands in for a captured graph on CPU: replay() runs what capture() records (the model over the graphs'
    static views; greedy: also the head and the argmax) into the graph's outputs."""

    def __init__(self, graphs: DecodeGraphs, bs: int, width: int, replays: list, greedy: bool):
        self.graphs, self.bs, self.width, self.replays, self.greedy = graphs, bs, width, replays, greedy

    def replay(self):
        g, key = self.graphs, (self.bs, self.width)
        self.replays.append((*key, self.greedy))
        args = g.step_args(*key)
        if self.greedy:
            for out, got in zip(g.greedy_outputs[key], g._greedy_step(args)):
                out.copy_(got)
        else:
            g.outputs[key].copy_(g.model(*args))


def _with_eager_graphs(engine, max_batch: int) -> list:
    runner, replays = engine.runner, []
    graphs = runner.plan_decode_graphs(max_batch, engine.max_model_len)
    hidden = runner.model_config.hidden_size
    for bs in graphs.buckets:
        for width in graphs.widths[bs]:
            graphs.graphs[bs, width] = EagerGraph(graphs, bs, width, replays, False)
            graphs.outputs[bs, width] = torch.empty(bs, hidden)
            if bs <= GREEDY_MAX_BATCH:
                graphs.greedy[bs, width] = EagerGraph(graphs, bs, width, replays, True)
                graphs.greedy_outputs[bs, width] = (torch.empty(bs, hidden), torch.empty(bs, dtype=torch.long))
    runner.decode_graphs = graphs
    return replays


def test_graph_inputs_give_the_eager_engines_tokens():
    """Decode steps through the packed inputs (padding rows, tokens carried from the step in flight; greedy rows
    through the graph that takes the argmax) give the tokens and logprobs of the engine without graphs."""
    prompts = ["The meaning of the word", 'What does "harbor" mean?', "Once upon a time", "A list of fruits:",
               "water " * 40]
    params = [SamplingParams(max_tokens=20, temperature=0), SamplingParams(max_tokens=14, temperature=0.8, seed=3,
                                                                           logprobs=1)]
    results = []
    for graphed in (False, True):
        engine = make_engine(DEMO_MODEL_DIR, max_model_len=256, max_num_seqs=8)
        replays = _with_eager_graphs(engine, 8) if graphed else []
        carried = []
        if graphed:
            graphs = engine.runner.decode_graphs
            real = graphs.pack_step

            def pack_step(seqs, rows):
                shape, packed, carries = real(seqs, rows)
                carried.append(carries)
                return shape, packed, carries
            graphs.pack_step = pack_step
        outs = [engine.generate(prompts, p) for p in params]
        results.append([[(o.outputs[0].token_ids, [round(lp.logprob, 4) for lp in o.outputs[0].logprobs or []])
                         for o in batch] for batch in outs])
        assert_all_blocks_free(engine)
        if graphed:
            # both kinds of graph ran (greedy rows: the argmax inside), with tokens carried from the step in flight
            assert {bs for bs, _, _ in replays} >= {8} and {g for _, _, g in replays} == {False, True}
            assert any(carried)
    assert results[0] == results[1]


def test_graph_inputs_carry_the_exact_window():
    """int4 with its exact window: the ring rows, ranges and slots travel in the packed inputs (padding rows write
    the spare row), so graphed decode steps give the eager engine's tokens and logprobs; the window off, the
    same steps differ (the graphs' ring inputs are what makes them equal)."""
    prompts = ["The meaning of the word", 'What does "harbor" mean?', "water " * 30]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=0)
    results = {}
    for graphed, exact in ((False, None), (True, None), (True, 0)):
        engine = make_engine(DEMO_MODEL_DIR, max_model_len=256, max_num_seqs=4, kv_cache_dtype="int4",
                             kv_exact_tokens=exact)
        replays = _with_eager_graphs(engine, 4) if graphed else []
        outs = engine.generate(prompts, params)
        results[graphed, exact] = [(o.outputs[0].token_ids, [round(lp.logprob, 3) for lp in o.outputs[0].logprobs])
                                   for o in outs]
        assert_all_blocks_free(engine)
        if graphed:
            assert {bs for bs, _, _ in replays} >= {4}
            layout = engine.runner.decode_graphs.inputs
            assert layout.exact == (exact is None) and layout.table_offset == (56 if exact is None else 36) * 4
    assert results[True, None] == results[False, None]
    assert results[True, 0] != results[True, None]


def test_graph_inputs_carry_the_lora_slots():
    """--enable-lora: each row's adapter slot travels in the packed inputs, so graphed decode steps of the base and
    two adapters in one batch give the eager engine's tokens; with the slots left at -1 (the base) they differ."""
    from quant_serve.engine.config import LoRAConfig
    from conftest import TESTS
    lora_dir = TESTS / "data" / "lora"
    config = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8,
                        lora_modules={name: str(lora_dir / name) for name in ("upper", "unsure")})
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f'What does "{w}" mean?'}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
               for w in ("lantern", "harbor", "pebble")]
    params = [SamplingParams(max_tokens=16, temperature=0, lora_name=name) for name in (None, "upper", "unsure")]
    results = {}
    for graphed, slots_packed in ((False, True), (True, True), (True, False)):
        engine = make_engine(DEMO_MODEL_DIR, max_model_len=256, max_num_seqs=4, lora=config)
        replays = _with_eager_graphs(engine, 4) if graphed else []
        if not slots_packed:
            engine.runner.lora.step_rows = lambda entries: None
        outs = engine.generate(prompts, params)
        results[graphed, slots_packed] = [o.outputs[0].token_ids for o in outs]
        assert_all_blocks_free(engine)
        if graphed:
            assert {bs for bs, _, _ in replays} >= {4} and engine.runner.decode_graphs.inputs.lora
    assert results[True, True] == results[False, True]
    assert results[True, False] != results[True, True]


def test_forwards_after_the_graphs_run_their_own_lora_rows():
    """Capturing (or running) the decode graphs points the LoRA layers at the graphs' rows; a forward of another
    size after them (the start-up warm-up, here) must not read those (the H100 start of a LoRA engine failed so)."""
    from quant_serve.engine.config import LoRAConfig
    from quant_serve.engine.worker.warmup import _warm_up_forward
    from conftest import TESTS
    config = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8,
                        lora_modules={"upper": str(TESTS / "data" / "lora" / "upper")})
    engine = make_engine(DEMO_MODEL_DIR, max_model_len=256, max_num_seqs=4, lora=config)
    graphs = engine.runner.plan_decode_graphs(4, engine.max_model_len)
    graphs.run_eagerly()
    assert engine.runner.lora.batch.slots is None
    _warm_up_forward(engine.runner, [], [40])                # 40 prefill rows, every one on slot 0
    assert engine.runner.lora.batch.slots is None
