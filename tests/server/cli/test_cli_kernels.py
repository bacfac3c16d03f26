"""`quant-serve kernels --explain`: on a machine without a GPU, per layer and M, the kernel each card's plan runs
(the same plan_w4a16 the forward asks), its tile and why, and the decode attention's splits."""
import json

from quant_serve.server.cli.main import main

from conftest import QWEN_7B

QWEN = str(QWEN_7B)


def explain(capsys, gpu: str, *extra: str) -> dict:
    assert main(["kernels", "--explain", "--gpu", gpu, "--model", QWEN, "--m", "1,16,64,256", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def kernels_at(plan: dict, layer: str) -> dict[int, str]:
    rows = next(entry for entry in plan["layers"] if entry["name"] == layer)["plans"]
    return {row["m"]: row["kernel"] for row in rows}


def test_explain_names_each_cards_kernels(capsys):
    a10, h200 = explain(capsys, "a10"), explain(capsys, "h200")
    assert a10["gpu"]["sms"] == 72 and not a10["gpu"]["tma"] and "derived" in a10["rules"]
    assert kernels_at(a10, "gate_up_proj") == {1: "mma.sync", 16: "mma.sync", 64: "mma.sync", 256: "dequant+cublas"}
    assert kernels_at(h200, "gate_up_proj") == {1: "mma.sync", 16: "mma.sync", 64: "tma", 256: "tma"}
    assert "H200" in h200["rules"]
    why = next(e for e in a10["layers"] if e["name"] == "o_proj")["plans"][3]["why"]
    assert "no TMA" in why
    # decode attention: eight sequences' contexts split to fill the a10's 72 SMs, fewer than the H200's 132 take
    a10_splits, h200_splits = ({(a["kv"], a["batch"]): a["splits"] for a in p["attention"]} for p in (a10, h200))
    assert 1 < a10_splits[("fp16", 8)] < h200_splits[("fp16", 8)]
    assert any("software" in a["note"] for a in a10["attention"] if a["kv"] == "fp8_e4m3")


def test_explain_text_and_this_gpu_without_one(capsys):
    assert main(["kernels", "--explain", "--gpu", "l4", "--model", QWEN, "--m", "1"]) == 0
    text = capsys.readouterr().out
    assert "NVIDIA L4" in text and "qkv_proj" in text and "M=1" in text and "decode attention" in text
    assert main(["kernels", "--explain", "--gpu", "this", "--model", QWEN]) == 2     # no CUDA GPU here
    assert "--gpu a10" in capsys.readouterr().err


def test_explain_int8_activations(capsys):
    """The integer path where it runs and why: int8 asked for runs it at every M for INT4 zero points, with the
    activation scales' granularity in its tile; GGUF's float offsets and groups of 32 stay fp16 and say why."""
    int8 = explain(capsys, "4090", "--activation-dtype", "int8", "--act-scale", "token")
    rows = [r for e in int8["layers"] for r in e["plans"]]
    assert {r["kernel"] for r in rows} == {"w4a8"} and {r["config"]["act_scale"] for r in rows} == {"token"}
    assert all("activation_dtype int8" in r["why"] for r in rows)
    offsets = explain(capsys, "4090", "--activation-dtype", "int8", "--weight-format", "w4-offsets")
    assert all(r["kernel"] != "w4a8" and "zero points" in r["why"] for e in offsets["layers"] for r in e["plans"])
    g32 = explain(capsys, "4090", "--activation-dtype", "int8", "--group-size", "32")
    assert all(r["kernel"] != "w4a8" and "group size 32" in r["why"] for e in g32["layers"] for r in e["plans"])
    assert main(["kernels", "--explain", "--gpu", "4090", "--model", QWEN, "--m", "256", "--activation-dtype",
                 "int8"]) == 0
    text = capsys.readouterr().out
    assert "w4a8" in text and "x quantized to int8 (a scale per group)" in text


def test_explain_gguf_weight_formats(capsys):
    """GGUF layers: INT4 with float offsets runs the kernels of its layout as zero-point INT4 does (every kernel
    takes offsets); int8 codes name the W8A16 GEMV at M = 1, its tl.dot row blocks up to DOT_MAX_M, then dequantize
    + cuBLAS."""
    offsets = explain(capsys, "h200", "--weight-format", "w4-offsets")
    w4 = explain(capsys, "h200", "--group-size", "32")
    assert offsets["weight_format"] == "w4-offsets"
    for layer in offsets["layers"]:
        assert layer["layout"] == "frag" and "offsets" in layer["layout_why"]
        assert kernels_at(offsets, layer["name"]) == kernels_at(w4, layer["name"])
    bf16 = explain(capsys, "h200", "--weight-format", "w4-offsets", "--dtype", "bfloat16")
    assert {r["kernel"] for e in bf16["layers"] for r in e["plans"]} <= {"gemv", "gemm", "gemmt", "dequant+cublas"}
    w8 = explain(capsys, "h200", "--weight-format", "w8")
    assert kernels_at(w8, "down_proj") == {1: "gemv", 16: "gemv-dot", 64: "gemv-dot", 256: "gemv-dot"}
    assert "group 32" in next(e for e in w8["layers"] if e["name"] == "o_proj")["plans"][0]["why"]
    assert main(["kernels", "--explain", "--gpu", "a10", "--model", QWEN, "--m", "1", "--weight-format", "w8"]) == 0
    assert "int8 codes" in capsys.readouterr().out


def test_explain_q6k_names_the_layout_its_dtype_runs(capsys):
    """Q6_K with fp16 activations: the W4A16 fragment layout and its tensor-core kernels (gate_up at M = 1 without
    the register cap); with bf16 the code planes and the W8A16 GEMV."""
    fp16 = explain(capsys, "h200", "--weight-format", "q6k")
    assert {e["layout"] for e in fp16["layers"]} == {"frag"} and "frag/q6k.py" in fp16["layers"][0]["layout_why"]
    gate_up = next(e for e in fp16["layers"] if e["name"] == "gate_up_proj")["plans"][0]
    assert gate_up["kernel"] == "mma.sync" and gate_up["config"]["max_regs"] == 0
    bf16 = explain(capsys, "h200", "--weight-format", "q6k", "--dtype", "bfloat16")
    assert {e["layout"] for e in bf16["layers"]} == {"q6k-planes"} and bf16["rules"].startswith("W8A16")
