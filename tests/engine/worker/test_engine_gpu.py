"""GPU machine only (skipped on CPU): the CUDA path (Triton kernels, CUDA graphs) against the CPU path."""
import pytest
import torch

from quant_serve.engine.sampling_params import SamplingParams
from helpers import assert_all_blocks_free, awq_model_dir, make_engine

from conftest import HELDOUT

pytestmark = pytest.mark.gpu


def _prompts(engine, n=8):
    ids = engine.tokenizer.encode(HELDOUT.read_text())
    return [ids[i * 211: i * 211 + 7 + 19 * i] for i in range(n)]


def _greedy(engine, prompts, logprobs=None):
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0, logprobs=logprobs)
    return engine.generate(prompts, params)


@pytest.mark.parametrize("kind", ["fp16", "awq"])
def test_cuda_greedy_matches_cpu(kind, trained_model):
    model = trained_model if kind == "fp16" else awq_model_dir()
    cpu = make_engine(model, dtype="float32")
    gpu = make_engine(model, dtype="float16", device="cuda", chunk=32)
    prompts = _prompts(cpu)
    ref = [o.outputs[0].token_ids for o in _greedy(cpu, prompts)]
    got = [o.outputs[0].token_ids for o in _greedy(gpu, prompts)]
    # fp16 on the GPU vs fp32 on the CPU: the first token of every prompt must agree, and nearly all tokens
    # (a near-tie can flip once the two precisions differ; a wrong kernel diverges almost everywhere)
    assert [g[0] for g in got] == [r[0] for r in ref]
    agree = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r)) / sum(len(r) for r in ref)
    assert agree >= 0.9, f"only {agree:.0%} of greedy tokens agree between CUDA and CPU"
    ids = prompts[3] + prompts[4]
    torch.testing.assert_close(gpu.score(ids), cpu.score(ids), atol=0.05, rtol=0.02)
    assert_all_blocks_free(gpu)


def test_cuda_graph_decode_matches_eager():
    eager = make_engine(awq_model_dir(), dtype="float16", device="cuda", enforce_eager=True)
    graphed = make_engine(awq_model_dir(), dtype="float16", device="cuda")
    graphs = graphed.runner.decode_graphs
    assert graphs is not None and eager.runner.decode_graphs is None
    assert graphs.widths[1] == [64, 128]               # 2 kv heads, 2048 tokens: graphs at 1024 and 2048 tokens
    used = set()

    class Replayed(dict):
        def __getitem__(self, key):
            used.add(key)
            return super().__getitem__(key)

    graphs.graphs = Replayed(graphs.graphs)
    short = _prompts(eager, 5)
    long = short + [eager.tokenizer.encode(HELDOUT.read_text())[:1100]]
    for prompts in (short, long):                      # the 1024-token graphs, then the 2048-token ones
        a = _greedy(eager, prompts, logprobs=1)
        b = _greedy(graphed, prompts, logprobs=1)
        for x, y in zip(a, b):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            lx = torch.tensor([lp.logprob for lp in x.outputs[0].logprobs])
            ly = torch.tensor([lp.logprob for lp in y.outputs[0].logprobs])
            torch.testing.assert_close(lx, ly, atol=2e-2, rtol=0)
    assert {width for _, width in used} == {64, 128}
    assert_all_blocks_free(graphed)


def test_greedy_graph_takes_the_argmax_inside_and_matches_eager():
    """Greedy rows without logprobs or min_tokens run the decode graph that holds the head and the argmax
    (engine/worker/cuda_graph.py, batches <= GREEDY_MAX_BATCH): same tokens as the eager engine, and its graphs ran."""
    eager = make_engine(awq_model_dir(), dtype="float16", device="cuda", enforce_eager=True)
    graphed = make_engine(awq_model_dir(), dtype="float16", device="cuda")
    graphs = graphed.runner.decode_graphs
    assert graphs.greedy and set(graphs.greedy) <= set(graphs.graphs)
    replayed = []

    class Spy:
        def __init__(self, key, graph):
            self.key, self.graph = key, graph

        def replay(self):
            replayed.append(self.key)
            self.graph.replay()

    graphs.greedy = {key: Spy(key, graph) for key, graph in graphs.greedy.items()}
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for prompts in (_prompts(eager, 1), _prompts(eager, 5)):
        a = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
        b = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
        assert a == b
    assert {bs for bs, _ in replayed} == {1, 8}
    assert_all_blocks_free(graphed)


def test_batch_one_folds_the_norms_and_matches_the_plain_path(monkeypatch):
    """Batch-1 decode on CUDA folds every RMSNorm into the INT4 matmuls around it (engine/models/fused_decode.py): the fixture takes that path, and its greedy tokens and logprobs are the plain path's (the
    variance is summed in another order: near-ties may flip, the rest agrees). o_proj merges the attention's
    split partials itself: the merge kernel's tokens (KernelOptions.fold_merge off)."""
    from dataclasses import replace

    from quant_serve.engine.models import fused_decode
    from quant_serve.kernels.attention.merge import DecodePartials
    from quant_serve.kernels.gpu import configure, runtime_for
    engine = make_engine(awq_model_dir(), dtype="float16", device="cuda", enforce_eager=True)
    model = engine.runner.model.model
    assert fused_decode.applies(model, torch.zeros(1, 8, device="cuda"))
    ids = engine.tokenizer.encode(HELDOUT.read_text())
    prompts = [ids[i * 500: i * 500 + 150 + 60 * i] for i in range(4)]     # 150-330 tokens: split contexts
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0, logprobs=1)
    inputs, real = [], fused_decode.residual

    def spy(linear, x, stream):
        inputs.append(type(x))
        return real(linear, x, stream)
    monkeypatch.setattr(fused_decode, "residual", spy)
    folded = [engine.generate([p], params)[0].outputs[0] for p in prompts]
    assert DecodePartials in inputs                       # o_proj merged the decode's split partials itself
    options = runtime_for(torch.device("cuda")).options
    configure(torch.device("cuda"), replace(options, fold_merge=False))
    try:
        merged_apart = [engine.generate([p], params)[0].outputs[0] for p in prompts]
    finally:
        configure(torch.device("cuda"), options)
    agree = sum(a == b for f, m in zip(folded, merged_apart) for a, b in zip(f.token_ids, m.token_ids)) / (16 * 4)
    assert agree >= 0.95, agree                    # the fp32 sum over splits in another order: a near-tie may flip
    monkeypatch.setattr(fused_decode, "applies", lambda model, x: False)
    plain = [engine.generate([p], params)[0].outputs[0] for p in prompts]
    assert [f.token_ids[0] for f in folded] == [p.token_ids[0] for p in plain]
    agree = sum(a == b for f, p in zip(folded, plain) for a, b in zip(f.token_ids, p.token_ids)) / (16 * 4)
    assert agree >= 0.95, agree
    for f, p in zip(folded, plain):
        n = next((i for i, (a, b) in enumerate(zip(f.token_ids, p.token_ids)) if a != b), 16)
        lf = torch.tensor([lp.logprob for lp in f.logprobs[:n]])
        lp_ = torch.tensor([lp.logprob for lp in p.logprobs[:n]])
        torch.testing.assert_close(lf, lp_, atol=2e-2, rtol=0)
    assert_all_blocks_free(engine)


def test_async_launch_never_waits_for_the_step_in_flight():
    """A launch behind a step in flight must queue everything: one synchronizing call (a pageable copy, .item(),
    a list index on a CUDA tensor) makes the host wait for the GPU and async scheduling silently stops paying."""
    engine = make_engine(awq_model_dir(), dtype="float16", device="cuda", chunk=64)
    launch, behind = engine.runner.launch, []

    def strict_launch(out, carry=None):
        if carry is None:
            return launch(out, carry)
        behind.append(len(out.scheduled))
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(out, carry)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine.runner.launch = strict_launch
    prompts = _prompts(engine, 6)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    for i, ids in enumerate(prompts[:3]):          # decodes in flight while later prompts are admitted in chunks
        engine.add_request(f"r{i}", ids, params)
    engine.step(), engine.step()
    for i, ids in enumerate(prompts[3:], start=3):
        engine.add_request(f"r{i}", ids * 4, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(behind) > 10
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_no_triton_compile_after_startup(kv, monkeypatch):
    """The start-up warm-up and graph capture compile every kernel variant serving reaches: one sequence decoding
    alone (graphs), prompts admitted beside it (mixed steps, run eagerly), the fp8 scale calibration of the first
    step, greedy and sampled rows. A variant compiled mid-run stalls every request in flight."""
    from triton.runtime.jit import JITFunction
    engine = make_engine(awq_model_dir(), dtype="float16", device="cuda", chunk=64, kv_cache_dtype=kv)
    compiled, real = [], JITFunction._do_compile

    def spy(self, *args, **kwargs):
        compiled.append(self.fn.__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", spy)
    prompts = _prompts(engine, 6)
    engine.add_request("alone", prompts[0], SamplingParams(max_tokens=24, temperature=0.0))
    for _ in range(4):
        engine.step()
    for i, ids in enumerate(prompts[1:4]):
        engine.add_request(f"r{i}", ids * 4, SamplingParams(max_tokens=8, temperature=0.8 if i else 0.0, seed=i))
    while engine.has_unfinished_requests():
        engine.step()
    assert compiled == []
    assert_all_blocks_free(engine)


def test_sample_copy_does_not_wait_for_later_work():
    """The sampled tokens' copy is queued with the step: resolving it must not wait for the step launched after."""
    from quant_serve.engine.sample.sampler import PendingSample
    tokens = torch.arange(8, device="cuda")
    pending = PendingSample(tokens, tokens, 8, [])
    torch.cuda._sleep(2_000_000_000)                      # ~1 s of GPU work queued behind the copy: the next step
    assert pending.resolve().token_ids == list(range(8))
    assert not torch.cuda.current_stream().query(), "resolve() waited for work queued after the sample"
    torch.cuda.synchronize()
