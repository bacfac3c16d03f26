"""The profiling scripts' parsers (bench/): what they write into bench/results must follow from ncu's output.
bench/ is a folder of scripts, not part of the package: the test loads the script by its path."""
import importlib.util

from conftest import REPO


def _bench_script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


summarize_source = _bench_script("ncu_w4a16").summarize_source

HEAD = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
        '"stall_barrier","stall_long_sb","stall_wait","stall_barrier (Not Issued)"')


def test_source_counters_summary_by_kernel_reason_and_line():
    # two kernels as ncu --page source --csv prints them: a header line naming the kernel, then the table
    csv_text = "\n".join([
        '"Kernel Name","_w4a16_mma_kernel",', HEAD,
        '"0x10","  LDG.E.128 R20, [R2.64]","6","6","0","6","0","0"',
        '"0x20","  BAR.SYNC.DEFER_BLOCKING 0x0","30","30","28","0","2","28"',
        '"0x30","  HMMA.16816.F32 R12, R36, R28, R12","4","1","0","0","4","0"',
        '"Kernel Name","_sk_reduce_kernel",', HEAD,
        '"0x10","  LDG.E R3, [R4.64]","10","10","0","10","0","0"',
    ])
    first, second = summarize_source(csv_text, top=2)
    assert first["kernel"] == "_w4a16_mma_kernel" and second["kernel"] == "_sk_reduce_kernel"
    assert first["samples"] == 40
    assert first["stall_share_pct"] == {"barrier": 70.0, "long_sb": 15.0, "wait": 15.0}   # "Not Issued" not counted
    assert [line["sass"] for line in first["top_lines"]] == ["BAR.SYNC.DEFER_BLOCKING 0x0", "LDG.E.128 R20, [R2.64]"]
    assert first["top_lines"][0] == {"sass": "BAR.SYNC.DEFER_BLOCKING 0x0", "share_pct": 75.0,
                                     "reasons": {"barrier": 28.0}}                       # reasons of 5 samples or more
    assert second["stall_share_pct"] == {"long_sb": 100.0}


def test_train_tiny_arch_writes_a_model_the_engine_serves(tmp_path):
    """bench/train_tiny_arch.py end to end at a toy size (the real run is on the GPU machine): a Gemma 2 (the
    architecture with the most features of its own) with the demo tokenizer, a held-out split that shares no
    document with training, and a checkpoint the engine loads and generates from with an int4 KV cache."""
    train = _bench_script("train_tiny_arch")
    docs = [f"doc {i}: " + "word " * 20 for i in range(200)]
    kept, held = train.split_corpus(docs)
    assert held and kept and not set(held) & set(kept) and len(kept) + len(held) == 200
    out = tmp_path / "tiny-gemma2"
    assert train.main(["--arch", "gemma2", "--out", str(out), "--steps", "2", "--batch", "1", "--seq", "32",
                       "--max-docs", "150"]) == 0
    import json
    stats = json.loads((out / "train_stats.json").read_text())
    assert stats["arch"] == "gemma2" and stats["tokens_seen"] == 64 and stats["val_loss"] > 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma2ForCausalLM"]
    assert (out / "heldout.txt").read_text() and (out / "chat_template.jinja").exists()
    from quant_serve.engine.config import CacheConfig, EngineConfig
    from quant_serve.engine.llm_engine import LLMEngine
    from quant_serve.engine.sampling_params import SamplingParams
    engine = LLMEngine(EngineConfig(model=str(out), device="cpu", dtype="float32", max_model_len=128,
                                    cache=CacheConfig(num_gpu_blocks=32, kv_cache_dtype="int4")), show_progress=False)
    got = engine.generate(["def main"], SamplingParams(max_tokens=3, min_tokens=3, temperature=0))[0]
    assert len(got.outputs[0].token_ids) == 3

