"""Broken checkpoints (issue 39, item 10): each is refused at load with one line naming the file (and the tensor)
and exit 2 from the CLI; before, NaN weights, an int64 norm, a top-level format mismatch and a stray shard loaded
with exit 0, and the config cases ended in tracebacks or errors that named no file."""
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from quant_serve.server.cli.main import main as cli

INDEX = "model.safetensors.index.json"


def linked_copy(src, dst, replace=()):
    """src's files as symlinks in dst, except the names in `replace` (the case writes those)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in replace:
            (dst / f.name).symlink_to(f)
    return dst


def shard_of(model, key):
    if (model / INDEX).is_file():
        return json.loads((model / INDEX).read_text())["weight_map"][key]
    return "model.safetensors"


def edit_tensor(src, dst, key, fn):
    shard = shard_of(src, key)
    linked_copy(src, dst, {shard})
    tensors = load_file(src / shard)
    tensors[key] = fn(tensors[key])
    save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    return shard


def edit_config(src, dst, fn):
    linked_copy(src, dst, {"config.json"})
    (dst / "config.json").write_text(json.dumps(fn(json.loads((src / "config.json").read_text()))))


# The cases run on the random Qwen2 (4 layers, intermediate 256, 3 shards: fixtures.RANDOM_QWEN2) and on its AWQ
# and compressed-tensors checkpoints (one file each), written by our quantizer.
def nan_weight(m, d):
    return edit_tensor(m.fp16, d, "model.layers.2.mlp.down_proj.weight",
                       lambda t: t.index_fill(0, torch.tensor([3]), float("nan")))


def inf_scale(m, d):
    return edit_tensor(m.awq, d, "model.layers.1.self_attn.q_proj.scales",
                       lambda t: t.index_fill(1, torch.tensor([5]), float("inf")))


def stray_shard(m, d):
    linked_copy(m.fp16, d)
    (d / "model-00004-of-00003.safetensors").symlink_to(m.fp16 / "model-00002-of-00003.safetensors")


def side_file_mismatch(m, d):
    linked_copy(m.awq, d)
    (d / "quantize_config.json").write_text(json.dumps({"quant_method": "gptq", "bits": 4, "group_size": 128}))


def text_file(name, text):
    def build(m, d):
        linked_copy(m.fp16, d, {name})
        (d / name).write_text(text)
    return build


def drop_layer(c):
    return c | {"num_hidden_layers": 3, "layer_types": c["layer_types"][:3]}


CASES = {  # name -> (build(models, dir), what the one line says; {d} is the case's directory)
    "nan-weight": (nan_weight, r"model\.layers\.2\.mlp\.down_proj\.weight in {d}/model-0000\d-of-00003\.safetensors "
                               r"holds 256 NaN or Inf values"),
    "inf-awq-scale": (inf_scale, r"model\.layers\.1\.self_attn\.q_proj\.scales in {d}/model\.safetensors holds 1 NaN"),
    "int64-norm": (lambda m, d: edit_tensor(m.fp16, d, "model.norm.weight", lambda t: t.to(torch.int64)),
                   r"model\.norm\.weight in {d}/model-00003-of-00003\.safetensors has dtype int64, expected a float"),
    "int8-dense-weight": (lambda m, d: edit_tensor(m.fp16, d, "model.layers.0.self_attn.q_proj.weight",
                                                   lambda t: t.to(torch.int8)),
                          r"model\.layers\.0\.self_attn\.q_proj\.weight has dtype int8.*\(in {d}/model-0000"),
    "ct-top-level-format": (lambda m, d: edit_config(m.ct, d, lambda c: c | {"quantization_config": c[
        "quantization_config"] | {"format": "float-quantized"}}),
                            r"{d}/config\.json quantization_config: compressed-tensors format 'float-quantized' "
                            r"disagrees with its config_groups"),
    "side-file-mismatch": (side_file_mismatch, r"{d}/quantize_config\.json says quant_method 'gptq' but "
                                               r"{d}/config\.json quantization_config says 'awq'"),
    "stray-shard": (stray_shard, r"{d}/model-00004-of-00003\.safetensors is not listed in {d}/model\.safetensors\."
                                 r"index\.json"),
    "config-is-a-list": (text_file("config.json", "[]"), r"{d}/config\.json must hold a JSON object, found "
                                                         r"list \[\]"),
    "quantization-config-string": (lambda m, d: edit_config(m.fp16, d, lambda c: c | {"quantization_config": "awq"}),
                                   r"{d}/config\.json: quantization_config must be an object"),
    "max-position-0": (lambda m, d: edit_config(m.fp16, d, lambda c: c | {"max_position_embeddings": 0}),
                       r"{d}/config\.json: max_position_embeddings must be a positive integer, got 0"),
    "fewer-layers": (lambda m, d: edit_config(m.fp16, d, drop_layer),
                     r"{d}/config\.json says num_hidden_layers = 3, but {d}/model-00002-of-00003\.safetensors holds "
                     r"model\.layers\.3\."),
    "bad-json-config": (text_file("config.json", '{"architectures": ["Qwen2ForCausalLM"],'),
                        r"{d}/config\.json is not valid JSON: Expecting property name .* line 1 column 40"),
    "bad-json-index": (text_file(INDEX, '{"weight_map": {'), r"{d}/model\.safetensors\.index\.json is not "
                                                            r"valid JSON"),
}


@pytest.fixture
def models(random_model, random_awq, random_ct):
    return SimpleNamespace(fp16=random_model, awq=random_awq, ct=random_ct)


@pytest.mark.parametrize("case", list(CASES))
def test_broken_checkpoint_is_one_line_and_exit_2(case, tmp_path, capsys, models):
    import re
    build, expected = CASES[case]
    model = tmp_path / case
    build(models, model)
    assert cli(["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    assert re.search(expected.format(d=re.escape(str(model))), lines[0]), lines[0]


def test_quantize_refuses_a_nan_source(tmp_path, capsys, models):
    nan_weight(models, tmp_path / "nan")
    assert cli(["quantize", str(tmp_path / "nan"), str(tmp_path / "out"), "--method", "rtn", "--device", "cpu"]) == 2
    assert "model.layers.2.mlp.down_proj.weight in" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
