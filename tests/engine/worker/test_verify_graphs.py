"""Verification steps under CUDA graphs (engine/spec/graphs.py): the packed inputs (rows of every entry, the padding
sequence, the bucket), checked with exact values; on CPU the graphs are stood in for by eager forwards over the same
static views, so the packing and the logits taken from the graph's head are checked end to end against the engine
without graphs; on the GPU the captured graphs against eager verification and against no speculation."""
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernel module is imported (decoration time)

from quant_serve.engine.config import SpeculativeConfig  # noqa: E402
from quant_serve.engine.sampling_params import SamplingParams  # noqa: E402
from quant_serve.engine.core.scheduler import ScheduledSeq  # noqa: E402
from quant_serve.engine.core.sequence import Sequence  # noqa: E402
from quant_serve.engine.spec.graphs import VerifyGraphs, VerifyInputs, VerifyRowGraphs  # noqa: E402
from quant_serve.kernels.gpu import KernelOptions  # noqa: E402
from quant_serve.kernels.interpret import patch_triton_interpreter  # noqa: E402

from conftest import GPU_PROFILE  # noqa: E402
from helpers import assert_all_blocks_free, bench_script, make_engine  # noqa: E402

patch_triton_interpreter()


def test_packed_inputs_read_back_through_the_device_views():
    layout = VerifyInputs(max_batch=4, tokens_per_seq=3, max_blocks=5)
    # two entries in the bucket of 4: a speculating one (3 tokens at 33..35) and a plain decode (1 token at 7)
    packed = layout.pack(4, ids=[[11, 12, 13], [21]], positions=[33, 7], slots=[[530, 531, 532], [119]],
                         tables=[[1, 6, 3], [7]])
    assert packed.dtype == np.uint8 and packed.size == layout.table_offset + 4 * 5 * 5
    blob = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)
    blob[:packed.size] = torch.from_numpy(packed)
    ids, positions, slots, seq_lens, starts, tables = layout.views(blob)
    assert ids.dtype == torch.int64 and seq_lens.dtype == torch.int32 and tuple(tables.shape) == (5, 5)
    assert ids.tolist() == [11, 12, 13, 21] + [0] * 8
    assert positions.tolist() == [33, 34, 35, 7] + list(range(8))         # the padding rows: positions 0..7
    assert slots.tolist() == [530, 531, 532, 119] + [-1] * 8              # padding stores nothing
    assert seq_lens.tolist() == [36, 8, 8, 0, 0]                          # the padding sequence: its own 8 rows
    assert starts.tolist() == [0, 3, 4, 12, 12, 12]                       # then sequences without rows
    assert tables.tolist() == [[1, 6, 3, 0, 0], [7, 0, 0, 0, 0]] + [[0] * 5] * 3
    # a full bucket leaves the padding sequence no rows; a smaller bucket packs fewer table bytes
    full = layout.pack(1, ids=[[5, 6, 7]], positions=[0], slots=[[16, 17, 18]], tables=[[1]])
    assert full.size == layout.table_offset + 4 * 2 * 5
    blob[:full.size] = torch.from_numpy(full)
    assert layout.views(blob)[3][:2].tolist() == [3, 0] and layout.views(blob)[4][:3].tolist() == [0, 3, 3]
    odd = VerifyInputs(max_batch=1, tokens_per_seq=5, max_blocks=4)       # 5 rows: columns of 48 bytes, aligned
    assert (odd.column_bytes, odd.lens_offset, odd.nbytes) == (48, 144, 144 + 4 * 2 + 4 * 3 + 4 * 2 * 4)


def test_pack_refuses_what_no_graph_holds():
    layout = VerifyInputs(max_batch=2, tokens_per_seq=3, max_blocks=4)
    with pytest.raises(ValueError, match="entry 0 forwards 4 tokens"):
        layout.pack(2, ids=[[1, 2, 3, 4]], positions=[0], slots=[[0, 1, 2, 3]], tables=[[0]])
    with pytest.raises(ValueError, match="3 entries for batch bucket 2"):
        layout.pack(2, ids=[[1]] * 3, positions=[0] * 3, slots=[[0]] * 3, tables=[[0]] * 3)


def test_pack_step_buckets_and_rows():
    graphs = VerifyGraphs(model=None, max_batch=6, tokens_per_seq=4, max_model_len=64, block_size=16, device="cpu")
    assert graphs.buckets == [1, 2, 4, 6] and [graphs.bucket_for(n) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]
    spec = Sequence("a", [3, 4, 5, 6, 7], SamplingParams())
    spec.num_computed_tokens, spec.block_table, spec.spec_token_ids = 4, [9], [40, 41, 42]
    plain = Sequence("b", list(range(20)), SamplingParams())
    plain.num_computed_tokens, plain.block_table = 19, [2, 5]
    bucket, packed, starts = graphs.pack_step([ScheduledSeq(spec, 4), ScheduledSeq(plain, 1)])
    assert bucket == 2 and starts == [0, 4, 5]
    ids, positions, slots, seq_lens, qsl, tables = graphs.inputs.views(packed)
    assert ids[:5].tolist() == [7, 40, 41, 42, 19] and positions[:5].tolist() == [4, 5, 6, 7, 19]
    assert slots[:8].tolist() == [148, 149, 150, 151, 83, -1, -1, -1]
    assert seq_lens[:3].tolist() == [8, 20, 3] and qsl[:4].tolist() == [0, 4, 5, 8]
    assert graphs.can_run([4, 1]) is False                                 # nothing captured yet
    graphs.graphs = {b: None for b in graphs.buckets}
    assert graphs.can_run([4, 1]) and not graphs.can_run([5]) and not graphs.can_run([1] * 7)


class RecordingModel:
    """Records what each warm-up forward's attention would be handed: (rows, query_start_loc)."""
    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, positions, meta):
        self.calls.append((input_ids.shape[0], meta.query_start_loc.tolist()))
        return torch.zeros(input_ids.shape[0], 8)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], 16)


def test_warmup_and_capture_inputs_stay_inside_each_bucket():
    """Each bucket's warm-up (and capture) forward has a padding sequence of exactly its own bs * t rows: the largest
    bucket's padding run past a smaller bucket's rows and the attention kernel wrote past its output."""
    model = RecordingModel()
    graphs = VerifyGraphs(model=model, max_batch=6, tokens_per_seq=4, max_model_len=64, block_size=16, device="cpu")
    graphs.run_eagerly()
    assert model.calls == [(24, [0, 24, 24, 24, 24, 24, 24, 24]), (16, [0, 16, 16, 16, 16, 16]),
                           (8, [0, 8, 8, 8]), (4, [0, 4, 4])]


class EagerGraph:
    """Stands in for a captured graph on CPU: replay() runs what capture() records into the graph's outputs."""

    def __init__(self, graphs: VerifyGraphs, bs: int, replays: list):
        self.graphs, self.bs, self.replays = graphs, bs, replays

    def replay(self):
        self.replays.append(self.bs)
        self.graphs.outputs[self.bs] = self.graphs.step(self.bs)


class EagerRowGraph:
    """The same for a graph of verification rows (a DecodeGraphs graph with the K/V stored first)."""

    def __init__(self, rows, key: tuple[int, int], replays: list):
        self.rows, self.key, self.replays = rows, key, replays

    def replay(self):
        self.replays.append(self.key[0])
        bs, width = self.key
        self.rows.outputs[self.key] = self.rows.model(self.rows.input_ids[:bs], self.rows.positions[:bs],
                                                      self.rows._meta(bs, width))


def _with_eager_verify_graphs(engine, k: int, as_rows: bool) -> list:
    runner, replays = engine.runner, []
    graphs = runner.plan_verify_graphs(engine.config.speculative.disable_by_batch_size, k + 1, engine.max_model_len,
                                       as_rows)
    if as_rows:
        for key in graphs.rows.shapes:
            graphs.rows.graphs[key] = EagerRowGraph(graphs.rows, key, replays)
    else:
        for bs in graphs.buckets:
            graphs.graphs[bs] = EagerGraph(graphs, bs, replays)
    return replays


def _compare_with_eager(runner, diffs: list) -> None:
    """Every graphed verification forward is followed by the eager one over the same entries: their logits go to
    diffs (max abs difference; the eager forward stores the same K/V again)."""
    real = runner.forward

    def forward(out, carry=None, greedy=False, verify=False):
        hidden, starts, logits = real(out, carry, greedy, verify)
        if logits is not None:
            logits = logits.clone()
            graphs, runner.verify_graphs = runner.verify_graphs, None
            eager, eager_starts, none = real(out, carry, greedy, verify)
            runner.verify_graphs = graphs
            assert none is None and eager_starts == starts and logits.shape[0] == starts[-1]
            diffs.append(float((runner.model.compute_logits(eager) - logits).abs().max()))
        return hidden, starts, logits
    runner.forward = forward


def _requests():
    copy = ("Copy this exactly: the quick brown fox jumps over the lazy dog, then the quick brown fox jumps over the "
            "lazy dog again. Copy: the quick brown fox")
    return [("copy", copy, SamplingParams(max_tokens=16, temperature=0)),
            ("count", "1, 2, 3, 4, 5, 6, 7,", SamplingParams(max_tokens=9, temperature=0)),
            ("random", copy, SamplingParams(max_tokens=10, temperature=0.8, seed=3))]


def _run(engine) -> dict:
    pending, results, steps = _requests(), {}, 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 2 == 0:
            engine.add_request(*pending.pop(0))
        steps += 1
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    return results


@pytest.mark.parametrize("as_rows", [False, True], ids=["prefill-kernel", "decode-rows"])
def test_graph_inputs_give_the_eager_verification_tokens(as_rows, trained_model):
    """Verification steps through the packed inputs (several buckets, entries with fewer proposals than k, plain
    decodes beside them, the padding sequence or padding rows) and the graph's all-row logits give the eager
    engine's tokens, random sampling included."""
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
                             disable_by_batch_size=4)
    results, stats = [], []
    for graphed in (False, True):
        engine = make_engine(trained_model, max_model_len=128, speculative=spec)
        replays = _with_eager_verify_graphs(engine, 3, as_rows) if graphed else []
        paths, diffs = [], []
        real = engine.runner.step_path
        engine.runner.step_path = lambda *a, **kw: paths.append(real(*a, **kw)) or paths[-1]
        if graphed:
            _compare_with_eager(engine.runner, diffs)
        results.append(_run(engine))
        assert all(d < 1e-4 for d in diffs), diffs
        stats.append((engine.spec_stats.num_drafts, engine.spec_stats.num_accepted_tokens))
        assert_all_blocks_free(engine)
        if graphed:
            assert "verify graph" in paths and len(set(replays)) >= 2, (paths, replays)
        else:
            assert "verify graph" not in paths
    assert results[0] == results[1] and stats[0] == stats[1] and stats[0][1] > 0


def _gpu_engine(model, **kw):
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                             disable_by_batch_size=4)
    return make_engine(model, dtype="float16", device="cuda", max_model_len=256, speculative=spec, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("as_rows", [False, True], ids=["prefill-kernel", "decode-rows"])
def test_cuda_verify_graph_logits_match_eager(as_rows, trained_model):
    """One verification step (entries of 5, 3 and 1 tokens: bucket 4 with a padding sequence, or 9 rows in the row
    bucket of 16) through the captured graph and eagerly over the same cache: the same logits up to fp16 rounding (the matmuls see 20 rows, not 9),
    the same argmax wherever it is not a near-tie."""
    from quant_serve.engine.core.scheduler import SchedulerOutput
    engine = _gpu_engine(trained_model)
    runner, bm = engine.runner, engine.block_manager
    # the kind the test names, whichever KernelOptions.verify_rows the engine took (rows of 1..20 tokens in the
    # decode graphs' pool, or batch buckets 1, 2, 4 of 5 tokens a sequence through the prefill kernel)
    runner.plan_verify_graphs(4, 5, engine.max_model_len, as_rows=as_rows)
    runner.capture_verify_graphs()
    if not as_rows:
        assert sorted(runner.verify_graphs.graphs) == [1, 2, 4]
    gen = torch.Generator().manual_seed(0)
    entries = []
    for i, (context, proposals) in enumerate([(37, 4), (70, 2), (16, 0)]):
        ids = torch.randint(3, engine.model_config.vocab_size, (context,), generator=gen).tolist()
        seq = Sequence(f"s{i}", ids, SamplingParams(max_tokens=None, temperature=0))
        assert bm.allocate_slots(seq, context + 8)
        runner.execute(SchedulerOutput([ScheduledSeq(seq, context - 1)], context - 1))     # the prefill
        seq.num_computed_tokens = context - 1
        seq.spec_token_ids = torch.randint(3, 1000, (proposals,), generator=gen).tolist()
        entries.append(ScheduledSeq(seq, 1 + proposals))
    out = SchedulerOutput(entries, sum(e.num_new_tokens for e in entries))
    assert runner.step_path(out, verify=True) == "verify graph"
    hidden_g, starts_g, logits_g = runner.forward(out, verify=True)
    logits_g = logits_g.clone()
    graphs, runner.verify_graphs = runner.verify_graphs, None
    hidden_e, starts_e, none = runner.forward(out, verify=True)
    runner.verify_graphs = graphs
    logits_e = engine.model.compute_logits(hidden_e)
    assert none is None and starts_g == starts_e == [0, 5, 8, 9] and logits_g.shape == logits_e.shape
    assert (logits_g - logits_e).abs().max() < 5e-2
    top2 = logits_e.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 5e-2
    assert clear.sum() >= 6 and torch.equal(logits_g.argmax(-1)[clear], logits_e.argmax(-1)[clear])


@pytest.mark.gpu
@pytest.mark.parametrize("as_rows", [False, True], ids=["prefill-kernel", "decode-rows"])
def test_cuda_verify_graphs_match_eager_and_plain(as_rows, trained_model):
    """On the GPU (fp16), greedy: the engine with verify graphs, the same engine with verification forced eager,
    and no speculation agree up to fp16 near-ties (verification runs the prefill kernel over 5 rows a sequence,
    decode the decode graphs over one)."""
    model = trained_model
    prompts = [prompt for _, prompt, _ in _requests()[:2]] + ["water " * 40]
    params = SamplingParams(max_tokens=32, temperature=0)

    def tokens(engine):
        return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]

    def agree(got, ref):
        return sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r)) / sum(len(r) for r in ref)
    plain = tokens(make_engine(model, dtype="float16", device="cuda", max_model_len=256))
    graphed_engine = _gpu_engine(model, kernels=KernelOptions(profile=GPU_PROFILE[0], verify_rows=as_rows))
    assert isinstance(graphed_engine.runner.verify_graphs, VerifyRowGraphs if as_rows else VerifyGraphs)
    paths = []
    real = graphed_engine.runner.step_path
    graphed_engine.runner.step_path = lambda *a, **kw: paths.append(real(*a, **kw)) or paths[-1]
    graphed = tokens(graphed_engine)
    eager_engine = _gpu_engine(model)
    eager_engine.runner.verify_graphs = None                     # the decode graphs stay: only verification eager
    eager = tokens(eager_engine)
    assert "verify graph" in paths and graphed_engine.spec_stats.num_accepted_tokens > 0
    assert [g[0] for g in graphed] == [e[0] for e in eager] == [r[0] for r in plain]
    assert agree(graphed, eager) >= 0.9 and agree(graphed, plain) >= 0.9, (agree(graphed, eager),
                                                                             agree(graphed, plain))
    assert_all_blocks_free(graphed_engine)
    eager_off = _gpu_engine(model, enforce_eager=True)
    assert eager_off.runner.verify_graphs is None and eager_off.runner.decode_graphs is None


def test_bench_projection_prefers_the_graphed_verify_cost():
    bench = bench_script("spec_decode")
    cost = {"decode_graph_ms": 1.6, "verify_1_over_decode": 1.9, "verify_2_over_decode": 2.0,
            "verify_4_over_decode": 2.2, "verify_graph_2_over_decode": 1.1, "verify_graph_4_over_decode": 1.2,
            "verify_graph_4_ms": 1.92}
    assert bench.interpolate(cost, 3) == pytest.approx(1.15) and bench.interpolate(cost, 1) == 1.9
    assert bench.interpolate({k: v for k, v in cost.items() if "graph_" not in k}, 3) == pytest.approx(2.1)
    rows = {**cost, "verify_rows_graph_2_over_decode": 1.0, "verify_rows_graph_4_over_decode": 1.04}
    assert bench.interpolate(rows, 3) == pytest.approx(1.02)                 # the default verification graphs


def test_memory_plan_counts_the_verify_logits(trained_model):
    import json
    from quant_serve.engine.config import EngineConfig, SchedulerConfig
    from quant_serve.engine.worker.kv_pool import verify_rows
    from quant_serve.engine.plan.memory import plan_memory
    config = json.loads((trained_model / "config.json").read_text())
    base, spec = plan_memory(config, max_model_len=256), plan_memory(config, max_model_len=256, verify_rows=20)
    assert spec.cuda_graph_bytes - base.cuda_graph_bytes == 20 * config["vocab_size"] * 4
    assert plan_memory(config, max_model_len=256, verify_rows=20, enforce_eager=True).cuda_graph_bytes == 0
    engine = EngineConfig(model=str(trained_model), scheduler=SchedulerConfig(max_num_seqs=3),
                          speculative=SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=8))
    assert verify_rows(engine) == 3 * 5 and verify_rows(EngineConfig(model=str(trained_model))) == 0


def test_dropped_proposals_are_no_backoff_miss(trained_model):
    """A step budget of one token: the scheduler drops every proposal (it never preempts for them), so none is
    verified and the back-off records none (before, each dropped proposal counted as a miss when the token decoded
    in its place differed)."""
    engine = make_engine(trained_model, chunk=1, max_model_len=128, speculative=SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, backoff_after=1))
    engine.add_request("r", "1, 2, 3, 4, 5, 6, 7, 1, 2, 3,", SamplingParams(max_tokens=8, temperature=0))
    records, proposed = engine.proposer.backoff.records, 0
    while engine.has_unfinished_requests():
        engine.step()
        proposed += bool(engine.scheduler.running and records)
        assert all(not r.proposals and not r.misses and not r.skip for r in records.values()), records
    assert proposed and engine.spec_stats.num_drafts == 0
