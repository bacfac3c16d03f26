"""Calibration text without a download: `quant-serve make-calib OUT.jsonl` writes a calibration file (stdlib
docstrings, WordNet glosses, text sampled from a model: engine/calib_samples.py, which also holds `quant-serve
quantize`'s default calibration)."""
import random
import sys
from pathlib import Path

import torch

from quant_serve.engine.calib_samples import model_samples
from quant_serve.quant.calib_data import docstring_documents, wordnet_entries, write_calib_jsonl


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "make-calib", help="write a calibration file (JSONL) for `quant-serve quantize --calib`",
        description="Build calibration text on this machine, never from the internet. Sources: Python stdlib "
                    "docstrings (default), WordNet glosses (Debian's wordnet-base), text sampled from a model.")
    p.add_argument("out", metavar="OUT.jsonl", type=Path)
    p.add_argument("--docstrings", action="store_true", help="Python stdlib docstrings (the default source)")
    p.add_argument("--max-docs", type=int, default=None, help="docstring documents to keep (default: all)")
    p.add_argument("--wordnet", type=Path, default=None, metavar="PATH",
                   help="WordNet 3.0 glosses from a wordnet-base .deb (`apt-get download wordnet-base`) or its "
                        "dict directory (/usr/share/wordnet)")
    p.add_argument("--wordnet-entries", type=int, default=8000)
    p.add_argument("--chat-model", default=None, metavar="MODEL_DIR",
                   help="render a share of the WordNet entries as chat turns with this model's chat template")
    p.add_argument("--chat-share", type=float, default=0.3)
    p.add_argument("--samples-from", default=None, metavar="MODEL_DIR",
                   help="add documents sampled from this model (temperature 1, from its start token)")
    p.add_argument("--samples", type=int, default=128, help="documents to sample with --samples-from")
    p.add_argument("--sample-len", type=int, default=512, help="tokens per sampled document")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled documents and the WordNet draw")
    p.add_argument("--device", default="auto", help="device for --samples-from: auto, cuda, cpu")
    p.set_defaults(func=cmd_make_calib)


def cmd_make_calib(args) -> int:
    docs, sources = [], []
    if args.docstrings or (args.wordnet is None and args.samples_from is None):
        docs += docstring_documents(args.max_docs)
        sources.append(f"Python {'.'.join(map(str, sys.version_info[:3]))} stdlib docstrings")
    if args.samples_from is not None:
        docs += model_samples(args.samples_from, args.samples, args.sample_len, args.seed, args.device)
        sources.append(f"{args.samples} samples of {args.sample_len} tokens from {Path(args.samples_from).name} "
                       f"(temperature 1, seed {args.seed}, torch {torch.__version__})")
    if args.wordnet is not None:
        chat = chat_renderer(args.chat_model) if args.chat_model else None
        rng = random.Random(args.seed + 1)
        entries = wordnet_entries(args.wordnet, args.wordnet_entries, args.seed)
        for word, entry in entries:
            use_chat = chat is not None and rng.random() < args.chat_share
            docs.append(chat(f'What does "{word}" mean?', entry).strip("\n") if use_chat else entry)
        sources.append(f"{len(entries)} WordNet 3.0 entries ({args.wordnet.name})"
                       + (f", {args.chat_share:.0%} as chat turns" if chat else ""))
    source = " + ".join(sources)
    write_calib_jsonl(args.out, docs, source)
    print(f"wrote {len(docs)} documents ({sum(map(len, docs)) / 1e6:.1f} M chars: {source}) to {args.out}")
    return 0


def chat_renderer(model_dir: str):
    from quant_serve.engine.load.loader import load_tokenizer
    tok = load_tokenizer(model_dir)
    return lambda q, a: tok.apply_chat_template([{"role": "user", "content": q},
                                                 {"role": "assistant", "content": a}], tokenize=False)
