"""The LoRA flags, named as vLLM's: --enable-lora, --lora-modules name=path ... (or vLLM's JSON form
'{"name": ..., "path": ...}'), --max-loras, --max-lora-rank, --max-cpu-loras."""
import argparse
import json

from quant_serve.engine.config import LoRAConfig


def add_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters per request (the OpenAI `model` field or `generate --lora` picks one)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help='PEFT adapters to load at start: name=path, or JSON \'{"name": ..., "path": ...}\'')
    p.add_argument("--max-loras", type=int, default=1, help="adapters on the device at once (a step may mix them)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank the slots take")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters loaded in host memory, swapped into the --max-loras slots as steps need them "
                        "(least recently used out; default: --max-loras)")


def parse_lora_modules(values: list[str] | None) -> dict[str, str]:
    modules: dict[str, str] = {}
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                item = json.loads(value)
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: --lora-modules {value!r} is not valid JSON ({e})")
            if not isinstance(item, dict) or not {"name", "path"} <= set(item):
                raise SystemExit(f"error: --lora-modules {value!r} needs \"name\" and \"path\"")
            name, path = item["name"], item["path"]
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise SystemExit(f"error: --lora-modules {value!r} is not name=path")
        if name in modules:
            raise SystemExit(f"error: --lora-modules names {name!r} twice")
        modules[name] = path
    return modules


def lora_config_from_args(args) -> LoRAConfig:
    modules = parse_lora_modules(getattr(args, "lora_modules", None))
    enable = bool(getattr(args, "enable_lora", False))
    if getattr(args, "lora", None):                  # generate --lora PATH: one adapter, used for the prompt
        enable, modules = True, {**modules, "lora": args.lora}
    try:
        return LoRAConfig(enable_lora=enable, max_loras=getattr(args, "max_loras", 1),
                          max_lora_rank=getattr(args, "max_lora_rank", 16), lora_modules=modules,
                          max_cpu_loras=getattr(args, "max_cpu_loras", None))
    except ValueError as e:
        raise SystemExit(f"error: {e}")
