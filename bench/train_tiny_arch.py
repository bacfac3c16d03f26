"""Trains a small model of another architecture (Llama, Gemma 2 or Qwen3) the way the shared tiny-qwen2 fixture was
made, so that accuracy claims (the int4 KV cache of issue #56, the int8 activations of #53) can be measured on a
second architecture: the fixture's size (hidden 512, 8 layers, 8 query / 2 KV heads, head_dim 64), its tokenizer
and chat template (the bundled demo model's), trained from scratch with AdamW on text that needs no download.

Corpus: the Python standard library's docstrings (quant/calib_data.py; the fixture saw the Python documentation
sources, fortunes and GCIDE, which are not on the machine), split 98 / 2 by a stable hash of each document; the
held-out 2% is written beside the model as heldout.txt for `quant-serve eval --data` and bench/kv_quant_accuracy.py.
The stdlib gives a few million tokens, so a full run repeats it (epochs are printed). Meant for the GPU machine
(the fixture saw 65M tokens: minutes on an H100); on the CPU --steps 3 checks the script end to end.

    python bench/train_tiny_arch.py --arch llama --out OUT/tiny-llama [--steps 2000] [--batch 64] [--seq 512]

Writes OUT/config.json, model.safetensors (fp16), the tokenizer files, heldout.txt and train_stats.json (steps,
tokens seen, train and held-out loss).
"""
import argparse
import hashlib
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SIZE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)


def make_config(arch: str, vocab_size: int, bos: int, eos: int, pad: int):
    from transformers import Gemma2Config, LlamaConfig, Qwen3Config
    common = dict(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, **SIZE)
    if arch == "llama":
        return LlamaConfig(rope_theta=10000.0, rms_norm_eps=1e-6, **common)
    if arch == "gemma2":       # Gemma 2's own features: sliding-window layers, soft-capping, sandwich norms
        return Gemma2Config(sliding_window=256, query_pre_attn_scalar=64, final_logit_softcapping=30.0,
                            attn_logit_softcapping=50.0, **common)
    if arch == "qwen3":
        return Qwen3Config(rms_norm_eps=1e-6, **common)
    raise ValueError(f"--arch must be llama, gemma2 or qwen3, not {arch!r}")


def split_corpus(docs: list[str]) -> tuple[list[str], list[str]]:
    """98 / 2 by a stable hash of each document (the same split on every machine with the same Python)."""
    train, held = [], []
    for doc in docs:
        (held if int(hashlib.sha1(doc.encode()).hexdigest(), 16) % 50 == 0 else train).append(doc)
    if not held and len(train) > 1:            # a small smoke corpus: hold out its last document
        held.append(train.pop())
    return train, held


def token_stream(docs: list[str], tokenizer, eos: int) -> torch.Tensor:
    ids: list[int] = []
    for doc in docs:
        ids += tokenizer.encode(doc, add_special_tokens=False) + [eos]
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def held_out_loss(model, ids: torch.Tensor, seq: int, device, dtype, max_windows: int = 64) -> float:
    model.eval()
    seq = min(seq, len(ids) - 1)               # a held-out split shorter than one window: one shorter window
    if seq < 1:
        return float("nan")
    n = min(max_windows, (len(ids) - 1) // seq)
    total = 0.0
    for i in range(n):
        x = ids[i * seq:(i + 1) * seq + 1].to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            logits = model(x[None, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(logits[0], x[1:]).item()
    model.train()
    return total / n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama", choices=["llama", "gemma2", "qwen3"])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop early (and still save) after this long: a device call has a hard time limit")
    p.add_argument("--max-docs", type=int, default=None, help="fewer documents (a CPU smoke run)")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from quant_serve.engine.load.demo import DEMO_MODEL_DIR
    from quant_serve.quant.calib_data import docstring_documents

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    demo = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    eos, bos, pad = demo["eos_token_id"], demo.get("bos_token_id", 0), demo.get("pad_token_id", 0)
    train_docs, held_docs = split_corpus(docstring_documents(args.max_docs))
    train_ids = token_stream(train_docs, tokenizer, eos)
    held_ids = token_stream(held_docs, tokenizer, eos)
    (out / "heldout.txt").write_text("\n<|endoftext|>\n".join(held_docs))
    print(f"corpus: {len(train_docs)} train documents ({len(train_ids):,} tokens), {len(held_docs)} held out "
          f"({len(held_ids):,} tokens)", flush=True)

    config = make_config(args.arch, demo["vocab_size"], bos, eos, pad)
    model = AutoModelForCausalLM.from_config(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / args.steps))))
    windows = (len(train_ids) - 1) // args.seq
    if windows < 1:
        raise SystemExit(f"corpus of {len(train_ids)} tokens is shorter than one --seq {args.seq} window")
    start, seen, loss, done = time.time(), 0, float("nan"), 0
    for step in range(args.steps):
        rows = torch.randint(0, windows, (args.batch,))
        x = torch.stack([train_ids[r * args.seq:(r + 1) * args.seq + 1] for r in rows.tolist()]).to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            logits = model(x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        seen, done = seen + args.batch * args.seq, step + 1
        if args.max_seconds and time.time() - start > args.max_seconds:
            print(f"step {step}: --max-seconds {args.max_seconds:.0f} reached, stopping early", flush=True)
            break
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f}, {seen:,} tokens ({seen / len(train_ids):.1f} epochs), "
                  f"{seen / (time.time() - start):,.0f} tok/s", flush=True)
    val = held_out_loss(model, held_ids, args.seq, device, dtype)
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    shutil.copy(DEMO_MODEL_DIR / "chat_template.jinja", out / "chat_template.jinja")
    stats = {"arch": args.arch, "steps": done, "planned_steps": args.steps, "tokens_seen": seen, "train_loss": loss.item(),
             "val_loss": val, "val_perplexity": math.exp(val), "corpus": "python stdlib docstrings",
             "python": sys.version.split()[0], "seconds": round(time.time() - start, 1)}
    (out / "train_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
