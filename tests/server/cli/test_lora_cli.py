"""The LoRA flags (server/cli/lora_args.py) and `quant-serve generate --lora PATH` on the INT4 demo model."""
import pytest

from conftest import TESTS
from quant_serve.server.cli.lora_args import parse_lora_modules
from quant_serve.server.cli.main import build_parser, main as cli
from quant_serve.server.cli.engine_args import engine_config_from_args

LORA = TESTS / "data" / "lora"


def test_lora_modules_take_name_path_and_vllm_json():
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == \
        {"a": "/x", "b": "/y"}
    for bad, message in (("nopath", "is not name=path"), ('{"name": "b"}', 'needs "name" and "path"'),
                         ("{oops", "is not valid JSON")):
        with pytest.raises(SystemExit, match=message):
            parse_lora_modules([bad])
    with pytest.raises(SystemExit, match="names 'a' twice"):
        parse_lora_modules(["a=/x", "a=/y"])


def test_engine_config_from_lora_flags():
    args = build_parser().parse_args(["serve", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
                                      "--lora-modules", "a=/x", "b=/y"])
    lora = engine_config_from_args(args).lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank, lora.lora_modules) == \
        (True, 3, 32, {"a": "/x", "b": "/y"})
    with pytest.raises(SystemExit, match="--lora-modules needs --enable-lora"):
        engine_config_from_args(build_parser().parse_args(["serve", "--lora-modules", "a=/x"]))
    with pytest.raises(SystemExit, match=r"2 --lora-modules do not fit --max-cpu-loras 1 \(default: --max-loras\)"):
        engine_config_from_args(build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/x",
                                                           "b=/y"]))


def test_generate_with_lora(capsys):
    common = ["generate", "--device", "cpu", "--num-gpu-blocks-override", "64", "--max-tokens", "12", "--chat",
              "--prompt", 'What does "lantern" mean?']
    assert cli(common + ["--lora", str(LORA / "upper"), "--max-lora-rank", "8"]) == 0
    upper = capsys.readouterr().out.strip()
    assert cli(common) == 0
    base = capsys.readouterr().out.strip()
    assert upper == upper.upper() and upper.startswith("LANTERN"), upper
    assert base != upper and base.upper().startswith(upper[:10]), (base, upper)


def test_generate_with_a_lora_above_the_rank_limit_fails_naming_the_tensor(capsys):
    assert cli(["generate", "--device", "cpu", "--num-gpu-blocks-override", "16", "--prompt", "x",
                "--lora", str(LORA / "upper"), "--max-lora-rank", "4"]) == 2
    assert "LoRA adapter 'lora': tensor base_model.model.model.layers.4" in capsys.readouterr().err
