"""The card model (engine/plan/card_model.py, issue #53 item 3): the rates table, the per-kernel time, the fit and its
reproduction of the committed runs, `plan --gpu`, and where the projections land against published figures."""
import json
import statistics
from dataclasses import replace
from collections import defaultdict

import pytest

from quant_serve.engine.plan.card_fit import Observation, fit, predict
from quant_serve.engine.plan.card_model import (CardParams, kernel_terms, kernel_time, params_for, project, step_time,
                                           tensor_rate)
from quant_serve.engine.plan.card_params import FITTED
from quant_serve.engine.plan.card_refit import fit_all
from quant_serve.engine.plan.card_step import Kernel, decode_kernels, model_shape
from quant_serve.engine.plan.memory import plan_memory
from quant_serve.engine.load.loader import BUNDLED_CONFIGS
from quant_serve.kernels.gpu import PROFILES, _caps, resolve_caps

from conftest import REPO

CONFIGS = BUNDLED_CONFIGS
RESULTS = REPO / "bench" / "results"
# dense FP16 tensor operations per SM-clock: GA102 / AD102 1,024 (FP16 accumulation), GA100 2,048, GH100 4,096
PER_SM_CLOCK = {(8, 6): 1024, (8, 9): 1024, (8, 0): 2048, (9, 0): 4096}


def config(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_has_its_rates(name):
    caps = PROFILES[name]
    assert caps.bandwidth_gbs > 0 and caps.sms > 0 and caps.boost_mhz > 0
    assert caps.fp16_tflops > 0 and caps.fp16_f32acc_tflops > 0 and caps.int8_tops > 0
    assert (caps.fp8_tflops > 0) == (caps.arch >= (8, 9))          # FP8 tensor cores from Ada on
    geforce = "GeForce" in caps.name
    # GeForce cards accumulate FP16 in FP32 at half rate; the data-centre cards at full rate
    assert caps.fp16_f32acc_tflops == pytest.approx(caps.fp16_tflops / (2 if geforce else 1), rel=0.01)
    assert caps.int8_tops == pytest.approx(2 * caps.fp16_tflops, rel=0.01)
    # the datasheet rate is SMs x clock x the architecture's ops per SM-clock (H100 / H200 quote theirs at 1,830
    # MHz, 8% under the boost clock): a typo in a rate or a clock fails here
    sm_rate = caps.sms * caps.boost_mhz * 1e6 * PER_SM_CLOCK[caps.arch] / 1e12
    assert caps.fp16_tflops == pytest.approx(sm_rate, rel=0.1)


def test_caps_keep_their_old_constructor_and_profiles_keep_rates_under_emulation():
    old = _caps("X", (8, 6), 10, 99, 6, 100, 8, "this")           # the signature other code calls
    assert old.fp16_tflops == 0 and old.boost_mhz == 0
    emulated = resolve_caps(PROFILES["h200"], "a10")
    assert emulated.fp16_tflops == PROFILES["a10"].fp16_tflops and emulated.bandwidth_gbs == 600


PARAMS = CardParams(eta_mem=0.8, eta_tc={"fp16_f32acc": 0.5, "fp16": 0.5, "int8": 0.5, "fp8": 0.5},
                    sm_bytes={"int4": 2.0}, sm_ops={"mma": 200.0}, launch_us=3.0, small_us=1.0, step_us=20.0)


@pytest.mark.parametrize("kernel,binds", [
    (Kernel("gemv", "fp16", 100e6, 2 * 16 * 4096 * 4096, "fp16_f32acc", "mma"), "dram"),
    (Kernel("gemm", "fp16", 10e6, 2e12, "fp16_f32acc"), "tensor"),
    (Kernel("dequant-bound", "int4", 100e6), "sm"),
    (Kernel("mma-bound", "fp16", 1e6, 4e11, "fp16_f32acc", "mma"), "sm"),
])
def test_kernel_time_is_the_largest_term_plus_the_launch(kernel, binds):
    caps, params = PROFILES["4090" if binds == "sm" else "a10"], PARAMS
    terms = kernel_terms(kernel, caps, params)
    seconds, binding = kernel_time(kernel, caps, params)
    assert binding == binds, terms
    assert seconds == pytest.approx(max(terms.values()) + params.launch_us * 1e-6)
    assert terms["dram"] == pytest.approx(kernel.nbytes / (0.8 * caps.bandwidth_gbs * 1e9))
    if kernel.ops:
        assert terms["tensor"] == pytest.approx(kernel.ops / (0.5 * tensor_rate(caps, "fp16_f32acc")))


def test_a_step_is_its_kernels_plus_the_step_time():
    caps = PROFILES["3090"]
    ks = [Kernel("a", "int4", 50e6), Kernel("norm", "small", 1e3), Kernel("b", "fp16", 1e6, 1e12, "fp16_f32acc")]
    step = step_time(ks, caps, PARAMS)
    assert step["seconds"] == pytest.approx(sum(kernel_time(k, caps, PARAMS)[0] for k in ks) + 20e-6)
    assert kernel_time(ks[1], caps, PARAMS)[0] == pytest.approx(1e3 / (0.8 * 936e9) + 1e-6)   # small: small_us
    # the 3090 accumulates FP16 in FP32 at 71 TFLOPS, half the 142 an FP16 accumulator gets
    assert kernel_terms(ks[2], caps, PARAMS)["tensor"] == pytest.approx(1e12 / (0.5 * 71e12))


def test_the_fit_separates_dram_from_the_sms_with_two_bandwidths():
    """Synthetic runs on the H100 and H200 (same SMs and clock, 3.35 / 4.8 TB/s) from known constants: the fit
    finds them again, which one GPU could not (its eta_mem and SM bytes per clock would trade)."""
    truth = CardParams(0.9, {"fp16_f32acc": 0.7}, {"int4": 15.0, "fp16": 30.0}, {"mma": 800.0}, 4.0, 2.0, 30.0)
    obs = []
    for gpu in ("h100", "h200"):
        for mb in (5, 20, 70, 140):
            for m, ops in ((1, 8), (64, 64)):
                k = Kernel("w", "int4", mb * 1e6, 2.0 * ops * mb * 1e6 * 2, "fp16_f32acc", "mma")
                obs.append(Observation(f"{gpu} {mb} {m}", gpu, "this", (k,), 0, 1.0, "synthetic"))
            obs.append(Observation(f"{gpu} fp16 {mb}", gpu, "this", (Kernel("c", "fp16", mb * 4e6, mb * 4e9,
                                                                           "fp16_f32acc"),), 0, 1.0, "synthetic"))
        obs.append(Observation(f"{gpu} step", gpu, "this", (Kernel("n", "small", 1e4),) * 50, 1, 1.0, "synthetic"))
    true = predict(obs, truth)
    obs = [Observation(o.label, o.gpu, o.profile, o.kernels, o.steps, t, o.source) for o, t in zip(obs, true)]
    start = CardParams(0.7, {"fp16_f32acc": 0.5}, {"int4": 6.0, "fp16": 6.0}, {"mma": 300.0}, 1.0, 1.0, 100.0)
    got, report = fit(obs, start)
    assert report["worst_error"] < 1e-3
    assert got.eta_mem == pytest.approx(0.9, rel=0.01) and got.sm_bytes["int4"] == pytest.approx(15.0, rel=0.01)
    assert got.launch_us == pytest.approx(4.0, rel=0.02) and got.sm_ops["mma"] == pytest.approx(800.0, rel=0.02)


@pytest.fixture(scope="module")
def fits():
    return fit_all(RESULTS)


@pytest.mark.parametrize("plan", ["sm90", "sm86"])
def test_the_fit_reproduces_the_committed_runs_within_5_percent(fits, plan):
    """Every measured configuration (GPU, model, KV dtype, batch) of the end-to-end runs the fit takes: the median
    of its committed runs within 5%, each run within 7% (the runs came from different commits: the H100's three
    batch-32 AWQ runs spread 1.6%)."""
    params, report, obs = fits[plan]
    steps = [o for o in obs if o.kind == "step"]
    assert {o.gpu for o in steps} >= ({"h100", "h200"} if plan == "sm90" else {"h200"})
    by_config = defaultdict(list)
    for o, t in zip(steps, predict(steps, params)):
        assert t / o.seconds - 1 == pytest.approx(0, abs=0.07), o.label
        by_config[o.label].append((o.seconds, t))
    for label, runs in by_config.items():
        measured = statistics.median(m for m, _ in runs)
        assert runs[0][1] / measured - 1 == pytest.approx(0, abs=0.05), label
    assert report["rms_error"] < 0.15               # the kernel benchmarks: a roofline, not every tile's quirks


def test_the_committed_constants_are_the_fit_of_the_committed_runs(fits):
    for plan, (params, _, _) in fits.items():
        kept = FITTED[plan]
        assert kept.source == params.source
        for name in ("eta_mem", "launch_us", "small_us"):
            assert getattr(kept, name) == pytest.approx(getattr(params, name), rel=0.02), (plan, name)
        assert kept.eta_tc["fp16_f32acc"] == pytest.approx(params.eta_tc["fp16_f32acc"], rel=0.02)
        assert kept.sm_bytes == pytest.approx(params.sm_bytes, rel=0.02)
        assert kept.sm_ops == pytest.approx(params.sm_ops, rel=0.02)


def test_runs_the_fit_does_not_see_stay_in_range(fits):
    """Llama-3.1-8B GPTQ (H200) and the GGUF mixes (H100): not fitted, reported in docs/performance.md (GGUF
    batch 32 is 20-23% under: the model runs its 64-row Hopper tiles at AWQ's rate). A gross break fails here."""
    from quant_serve.engine.plan.card_refit import observations
    params = fits["sm90"][0]
    checks = observations("sm90", RESULTS, fit=False)
    assert len(checks) >= 4
    for o, t in zip(checks, predict(checks, params)):
        assert t / o.seconds - 1 == pytest.approx(0, abs=0.3), o.label


def test_step_bytes_are_the_memory_plans():
    """The weights a step reads (the card model's per-layer bytes) are engine/plan/memory.py's plan less the embedding
    table, to 0.1%, for every format the projections use."""
    for name, quantization in (("qwen2.5-7b-instruct", None), ("llama-3.1-8b-instruct", None),
                               ("qwen2.5-7b-instruct", "gguf:Q4_K_M"), ("llama-3.1-8b-instruct", "gguf:Q4_0"),
                               ("qwen2.5-7b-instruct", "gguf:Q8_0")):
        shape = model_shape(config(name), quantization)
        plan = plan_memory(CONFIGS / name, quantization=quantization)
        assert shape.step_weight_bytes == pytest.approx(plan.weights_bytes - plan.embedding_bytes, rel=1e-3)


def test_a_gguf_files_step_reads_what_its_plan_holds(tmp_path, trained_model):
    """A GGUF file's own tensor types (the tiny model as Q4_K_M, a tied head: the FP16 embedding table)."""
    from gguf_fixtures import write_gguf
    from quant_serve.engine.plan.card_model import projection_for
    path = write_gguf(trained_model, tmp_path / "tiny.gguf", "Q4_K_M")
    plan = plan_memory(path)
    projection = projection_for(path, PROFILES["l4"])
    assert plan.tied_embeddings
    assert projection["inputs"]["weight_bytes_per_step"] == pytest.approx(plan.weights_bytes, rel=1e-3)
    assert projection["decode"][0]["tok_s"] > 0


def test_plan_gpu_prints_the_three_figures_with_their_inputs(capsys):
    from quant_serve.server.cli import main as cli
    assert cli.main(["plan", "qwen2.5-7b-instruct", "--gpu", "a10"]) == 0
    out = capsys.readouterr().out
    for text in ("decode batch  1:", "decode batch 32:", "prefill   512 tokens:", "prefill 4,096 tokens:",
                 "600 GB/s", "72 SMs", "fp16_f32acc 125", "eta_mem", "launch", "bound by dram", "GB a step"):
        assert text in out, text
    cli.main(["plan", "qwen2.5-7b-instruct", "--gpu", "4090", "--json"])
    projection = json.loads(capsys.readouterr().out)["projection"]
    assert [d["batch"] for d in projection["decode"]] == [1, 32]
    assert [p["prompt"] for p in projection["prefill"]] == [512, 4096]
    assert projection["inputs"]["tensor_tflops"]["fp16_f32acc"] == 165.2
    assert all(d["tok_s"] > 0 and d["binds"] for d in projection["decode"] + projection["prefill"])


def roofline_fraction(gpu: str, name: str, quantization: str | None) -> tuple[float, dict]:
    caps = PROFILES[gpu]
    shape = model_shape(config(name), quantization)
    pr = project(shape, caps, params_for(caps)[0], context=512)
    return pr["decode"][0]["tok_s"] * shape.step_weight_bytes / (caps.bandwidth_gbs * 1e9), pr


@pytest.mark.parametrize("gpu", ["4090", "3090"])
def test_batch_1_on_the_cards_lands_where_published_engines_do(gpu):
    """Llama-3-8B Q4_0-like bytes at batch 1: llama.cpp 157 tok/s on a 3090 (77% of bandwidth), ExLlamaV2 207
    tok/s on a 4090 (Llama-2-7B 4.0 bpw, 74%). Bounds 65-85%: the anchors +-10 points, the spread of what the fit
    cannot know about a GDDR6X card (its DRAM efficiency, fit on HBM: 0.95 against 0.90 would move 5 points; a
    launch on it). Below 65% repeats the scaled-efficiency error (110 tok/s on a 4090 was 49%); above 85% would
    mean the ~150 launches of a step cost nothing."""
    fraction, pr = roofline_fraction(gpu, "llama-3.1-8b-instruct", "gguf:Q4_0")
    assert 0.65 <= fraction <= 0.85, fraction
    assert pr["decode"][0]["binds"] == "dram"


def test_prefill_on_a_4090_is_bound_by_fp16_with_fp32_accumulation():
    """Our prefill runs dequantize + cuBLAS FP16 (FP32 accumulation: 165 TFLOPS on a 4090); llama.cpp's MMQ runs
    INT8 tensor cores (661 TOPS) for 10.4k tok/s pp512 on Llama-3-8B Q4_0 (llama.cpp PR 7676): the projection must
    say tensor-bound and below that."""
    _, pr = roofline_fraction("4090", "llama-3.1-8b-instruct", "gguf:Q4_0")
    pp512 = pr["prefill"][0]
    assert pp512["binds"] == "tensor" and 3000 < pp512["tok_s"] < 10_400


def test_decode_kernels_follow_the_plan():
    """Batch 1 on an AWQ model runs the folded path (5 launches a layer); batch 32 adds norms and RoPE; prefill on
    the sm86 plan dequantizes then calls cuBLAS (two launches a matmul)."""
    shape = model_shape(config("qwen2.5-7b-instruct"))
    b1 = decode_kernels(shape, PROFILES["a10"], 1, 512)
    b32 = decode_kernels(shape, PROFILES["a10"], 32, 512)
    assert sum(k.family == "small" for k in b1) == 3 and len(b1) == 28 * 5 + 4
    assert sum(k.name == "norm" for k in b32) == 2 * 28 + 1
    from quant_serve.engine.plan.card_step import prefill_kernels
    pre = prefill_kernels(shape, PROFILES["a10"], 512)
    assert sum(k.family == "dequant" for k in pre) == 4 * 28


def test_bench_card_model_json_replaces_the_committed_runs(tmp_path):
    """Two card-model-*.json files of one plan (bench/card_model.py's schema; here made from known constants) are
    what that plan is fitted from, eta_mem and all, and the fit gives the constants back."""
    from quant_serve.engine.plan.card_refit import fit_plan, observations
    from quant_serve.engine.plan.card_runs import card_observations
    truth = replace(FITTED["sm86"], derived={}, source="")
    for gpu in ("h100", "h200"):
        d = {"gpu_key": gpu, "profile": "a10", "git_commit": "0" * 40,
             "matmuls": [{"format": f, "shape": s, "k": k, "n": n, "m": m, "kernel": kern, "us": 1.0}
                         for s, (k, n) in (("gate_up", (3584, 37888)), ("down", (18944, 3584)))
                         for m in (1, 16, 32, 64, 512)
                         for f, kern in (("fp16", "cublas"), ("ours", "mma.sync" if m <= 64 else "dequant+cublas"))],
             "attention": [{"batch": b, "context": c, "kv_bytes": 2, "bytes": 2 * b * c * 1024 * 2, "us": 1.0}
                           for b, c in ((1, 512), (32, 1024))],
             "e2e": [{"model": "qwen2.5-7b-awq", "kv": "auto", "kind": "decode", "batch": b, "context": 192,
                      "tok_s": 1.0} for b in (1, 32)]
             + [{"model": "qwen2.5-7b-awq", "kv": "auto", "kind": "prefill", "prompt": 512, "chunk": 8192,
                 "seconds": 1.0, "tok_s": 1.0}]}
        obs = card_observations(d, "synthetic")
        seconds = iter(predict(obs, truth))
        for row in d["matmuls"] + d["attention"]:
            row["us"] = next(seconds) * 1e6
        for row in d["e2e"]:
            t = next(seconds)
            row.update({"tok_s": row["batch"] / t} if row["kind"] == "decode" else {"seconds": t})
        (tmp_path / f"card-model-{gpu}-a10.json").write_text(json.dumps(d))
    assert {o.source.split()[0] for o in observations("sm86", tmp_path)} == {"card-model-h100-a10.json",
                                                                           "card-model-h200-a10.json"}
    params, report, _ = fit_plan("sm86", tmp_path, FITTED["sm90"])
    assert report["worst_error"] < 0.02
    assert "eta_mem" not in params.derived            # two GPUs: fitted, not borrowed
    assert params.eta_mem == pytest.approx(truth.eta_mem, rel=0.03)
