"""The `quant-serve` command: generate, serve, quantize, eval, plan, bench. The one module that imports every layer."""
import argparse
import logging
import os
import sys

from quant_serve.server.cli.engine_args import ArgumentParser, add_engine_args, engine_config_from_args


def cmd_generate(args) -> int:
    from quant_serve.engine.llm_engine import LLMEngine
    from quant_serve.engine.sampling_params import SamplingParams
    engine = LLMEngine(engine_config_from_args(args))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, stop=args.stop or [],
                            lora_name="lora" if args.lora else None)
    output = engine.generate([prompt], params)[0]
    sys.stdout.write(output.outputs[0].text + "\n")
    sys.stdout.flush()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="quant-serve", description="Quantization-first LLM inference engine")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)

    gen = sub.add_parser("generate", help="generate a completion for one prompt and print it")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append")
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to the prompt")
    gen.add_argument("--lora", default=None, metavar="PATH", help="generate with this PEFT LoRA adapter")
    gen.set_defaults(func=cmd_generate)

    from quant_serve.server.cli import bench as cli_bench
    from quant_serve.server.cli import calib as cli_calib
    from quant_serve.server.cli import eval as cli_eval
    from quant_serve.server.cli import kernels as cli_kernels
    from quant_serve.server.cli import plan as cli_plan
    from quant_serve.server.cli import quantize as cli_quantize
    from quant_serve.server.cli import serve as cli_serve
    for module in (cli_serve, cli_quantize, cli_calib, cli_eval, cli_plan, cli_bench, cli_kernels):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
