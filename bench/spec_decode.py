"""Speculative decoding: what verification costs on the GPU, what is accepted on real text, and the projected
batch-1 speedup from the two.

    python bench/spec_decode.py verify-cost --out bench/results/spec-verify-cost-h200.json       # GPU
    python bench/spec_decode.py acceptance --out bench/results/spec-acceptance-tiny-qwen2.json   # CPU is fine
    python bench/spec_decode.py project --acceptance B.json [--verify-cost A.json] [--out C.json]

verify-cost: dummy Qwen2.5-7B AWQ under a 24 GiB cap (as bench/e2e.py builds it); median time of one target step
that forwards t tokens per sequence (t = 1, 2, 4, 5, 8: the last known token + t - 1 proposals) and takes the logits
of all of them, at batch 1, 4, 16, next to the plain decode step (CUDA graph) at t = 1: eager (verify_{t}_ms) and,
for t >= 2 on CUDA, replaying the verification graph of that t (verify_graph_{t}_ms: the varlen prefill kernel,
the default; verify_rows_graph_{t}_ms: one decode row per token, KernelOptions.verify_rows; engine/spec/graphs.py;
the issue-37 goal: <= 1.25 x decode_graph_ms at t = 5, batch 1). project uses verify_graph_{t} where present.
acceptance: tiny-qwen2 target, greedy, k proposals; prompt lookup and draft models (--drafts: tiny-qwen2 cut to its
first N layers, or a directory such as the shared tiny-qwen2-awq: the target in INT4 as its own draft) on a
copy-heavy task (a held-out paragraph of
/work/shared/data/val.txt, then its start again: the model continues by copying) and free generation (the start of
a paragraph alone).
project: time per token relative to plain decode = (speculating steps x verify cost ratio at k + 1 tokens
[+ k draft forwards x draft cost ratio] + plain decode steps) / tokens; speedup = its inverse. Without a
verify-cost JSON it gives the break-even: the largest verify cost ratio at which each method still reaches 1.0x
and 1.6x.
"""
import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
TINY = SHARED / "models" / "tiny-qwen2"
VAL = SHARED / "data" / "val.txt"
DRAFT_LAYERS = 2
K = 4
BATCHES = (1, 4, 16)
TOKENS = (1, 2, 4, 5, 8)                 # tokens per sequence a verification forwards (k + 1)


def truncated_model(model_dir: Path, num_layers: int, out_dir: Path) -> Path:
    """model_dir's first num_layers decoder layers (+ embeddings, final norm, head) as a checkpoint: a cheap draft
    with the same tokenizer."""
    from safetensors.torch import load_file, save_file
    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers:
                continue
            weights[name] = t
    save_file(weights, str(out_dir / "model.safetensors"))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:num_layers]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for f in Path(model_dir).iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            (out_dir / f.name).write_bytes(f.read_bytes())
    return out_dir


def paragraphs(n: int, min_chars: int = 200) -> list[str]:
    docs = [d.strip() for d in VAL.read_text().split("<|endoftext|>")]
    return [d for d in docs if len(d) >= min_chars and "<|im_start|>" not in d][:n]


def tasks(n: int) -> dict[str, list[str]]:
    paras = paragraphs(n)
    return {"copy": [f"{p}\n<|endoftext|>\n{p[:40]}" for p in paras],      # the paragraph, then its start again
            "free": [p[:40] for p in paras]}


def run_acceptance(args) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from quant_serve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from quant_serve.engine.llm_engine import LLMEngine
    from quant_serve.engine.sampling_params import SamplingParams
    methods = {"ngram": SpeculativeConfig(num_speculative_tokens=K, prompt_lookup_min=args.ngram_min,
                                          prompt_lookup_max=args.ngram_max, disable_by_batch_size=64)}
    drafts = {}
    for draft in args.drafts:
        if draft.startswith("cut:"):
            layers = int(draft[4:])
            path = truncated_model(TINY, layers, Path(args.work) / f"tiny-qwen2-{layers}-layers")
            drafts[f"draft_model:tiny-qwen2-first-{layers}-of-8-layers"] = path
        else:
            drafts[f"draft_model:{Path(draft).name}"] = Path(draft)
    for name, path in drafts.items():
        methods[name] = SpeculativeConfig(method="draft_model", model=str(path), num_speculative_tokens=K,
                                          disable_by_batch_size=64)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    result = {"target": str(TINY), "drafts": {k: str(v) for k, v in drafts.items()},
              "ngram": {"prompt_lookup_min": args.ngram_min, "prompt_lookup_max": args.ngram_max},
              "backoff_after": methods["ngram"].backoff_after,
              "num_speculative_tokens": K, "max_tokens": args.max_tokens, "device": "cpu", "greedy": True,
              "copy_task": "a held-out val.txt paragraph, <|endoftext|>, then its first 40 characters again",
              "free_task": "the first 40 characters of the paragraph alone", "tasks": {}}
    for task, prompts in tasks(args.num_prompts).items():
        for name, spec in methods.items():
            engine = LLMEngine(EngineConfig(model=str(TINY), dtype="float32", device="cpu", max_model_len=1024,
                                            cache=CacheConfig(num_gpu_blocks=512),
                                            scheduler=SchedulerConfig(max_num_seqs=64), speculative=spec),
                               show_progress=False)
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            s = engine.spec_stats
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
            # decode entries that did not speculate: every token not emitted by a verification, less the first
            # token of each request (sampled by its prefill); an EOS inside an accepted run drops the rest (>= 0)
            plain = max(0, generated - s.num_drafts - s.num_accepted_tokens - len(prompts))
            result["tasks"].setdefault(task, {})[name] = {
                "num_prompts": len(prompts), "generated_tokens": generated, "num_drafts": s.num_drafts,
                "num_draft_tokens": s.num_draft_tokens, "num_accepted_tokens": s.num_accepted_tokens,
                "accepted_per_pos": list(s.accepted_per_pos), "acceptance_rate": round(s.acceptance_rate, 4),
                "mean_accepted_per_draft": round(s.num_accepted_tokens / max(1, s.num_drafts), 4),
                "mean_accepted_length": round(s.mean_accepted_length, 4), "plain_decode_steps": plain,
                "cpu_seconds": round(time.perf_counter() - start, 2)}
            print(task, name, result["tasks"][task][name], file=sys.stderr)
    return result


@torch.inference_mode()
def run_verify_cost(args) -> dict:
    sys.path.insert(0, str(REPO / "bench"))
    from e2e import CONFIGS, engine_for
    from quant_serve.engine.core.scheduler import ScheduledSeq, SchedulerOutput
    from quant_serve.engine.sampling_params import SamplingParams
    from quant_serve.engine.core.sequence import Sequence
    if args.model is None:
        engine = engine_for(CONFIGS["qwen2.5-7b-awq"], "auto", 64, 4096, False)
        model = "dummy Qwen2.5-7B AWQ g128, 24 GiB cap"
    else:                    # a local model on this machine's device (checks the script itself on the CPU)
        from quant_serve.engine.config import CacheConfig, EngineConfig
        from quant_serve.engine.llm_engine import LLMEngine
        engine = LLMEngine(EngineConfig(model=args.model, max_model_len=args.context + 64,
                                        cache=CacheConfig(num_gpu_blocks=64 * (args.context // 16 + 2))),
                           show_progress=False)
        model = args.model
    runner, bm = engine.runner, engine.block_manager
    vocab = engine.model_config.vocab_size
    result = {"model": model, "device": str(engine.device), "context": args.context, "steps": {}}
    gen = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if engine.device != "cpu" else (lambda: None)

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        sync()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    graphed = engine.device != "cpu" and runner.decode_graphs is not None
    result["verify_graphs"] = graphed
    for batch in BATCHES:
        seqs = []
        for i in range(batch):
            ids = torch.randint(3, vocab, (args.context,), generator=gen).tolist()
            seq = Sequence(f"b{batch}-{i}", ids, SamplingParams(max_tokens=None, temperature=0))
            assert bm.allocate_slots(seq, args.context + 8)
            runner.execute(SchedulerOutput([ScheduledSeq(seq, args.context)], args.context))   # the prefill
            seq.num_computed_tokens = args.context - 1        # re-decode the last token: context stays fixed
            seqs.append(seq)
        row = {"decode_graph_ms": 1e3 * timed(lambda: runner.execute(
            SchedulerOutput([ScheduledSeq(s, 1) for s in seqs], batch)))}
        for t in TOKENS:
            for s in seqs:
                s.spec_token_ids = [5] * (t - 1)
            out = SchedulerOutput([ScheduledSeq(s, t) for s in seqs], batch * t)

            def verify():
                hidden, starts, _ = runner.forward(out)
                engine.model.compute_logits(hidden).argmax(dim=-1)
            row[f"verify_{t}_ms"] = 1e3 * timed(verify)
            for as_rows, key in ((False, "verify_graph"), (True, "verify_rows_graph")):
                if t < 2 or not graphed:
                    continue
                # the graphs of this batch and t alone (one set at a time)
                runner.plan_verify_graphs(batch, t, engine.max_model_len, as_rows)
                runner.capture_verify_graphs()

                def verify_graph():
                    hidden, starts, logits = runner.forward(out, verify=True)
                    logits.argmax(dim=-1)
                assert runner.step_path(out, verify=True) == "verify graph"
                row[f"{key}_{t}_ms"] = 1e3 * timed(verify_graph)
                runner.verify_graphs = None
            for s in seqs:
                s.spec_token_ids = []
        row.update({k.replace("_ms", "_over_decode"): v / row["decode_graph_ms"] for k, v in list(row.items())
                    if k.startswith("verify_")})
        result["steps"][f"batch_{batch}"] = row
        print(batch, row, file=sys.stderr)
        for s in seqs:
            bm.free(s)
    return result


def interpolate(cost: dict, tokens: int) -> float:
    """Verify cost ratio at `tokens` tokens per sequence, linear between the measured ones (1, 2, 4, 5, 8): the
    graphed step's where measured (t >= 2; the graphs the engine runs by default, KernelOptions.verify_rows), else
    the eager one's."""
    from quant_serve.kernels.gpu import KernelOptions
    eager = {int(m.group(1)): v for k, v in cost.items() if (m := re.fullmatch(r"verify_(\d+)_over_decode", k))}
    kinds = ["verify_rows_graph", "verify_graph"]
    if not KernelOptions().verify_rows:
        kinds.reverse()
    graphed = {}
    for kind in kinds:
        graphed = {int(m.group(1)): v for k, v in cost.items() if (m := re.fullmatch(kind + r"_(\d+)_over_decode", k))}
        if graphed:
            break
    points = sorted({**eager, **graphed}.items())
    for (t0, c0), (t1, c1) in zip(points, points[1:]):
        if t0 <= tokens <= t1:
            return c0 + (c1 - c0) * (tokens - t0) / (t1 - t0)
    return points[-1][1]


def project(verify: dict, acceptance: dict, draft_cost_ratio: float) -> dict:
    cost = verify["steps"]["batch_1"]
    k = acceptance["num_speculative_tokens"]
    c = interpolate(cost, k + 1)
    out = {"verify_over_decode_at_k_plus_1": c, "draft_cost_ratio": draft_cost_ratio, "tasks": {}}
    for task, methods in acceptance["tasks"].items():
        for name, m in methods.items():
            tokens = m["generated_tokens"] - m["num_prompts"]            # decode tokens (the first is the prefill's)
            draft_cost = k * draft_cost_ratio if name.startswith("draft_model") else 0.0
            time_units = m["num_drafts"] * (c + draft_cost) + m["plain_decode_steps"]
            out["tasks"].setdefault(task, {})[name] = {"projected_speedup": round(tokens / time_units, 3)}
    return out


def break_even(acceptance: dict, draft_cost_ratio: float, speedups=(1.0, 1.6)) -> dict:
    """Without a GPU measurement: the largest verify cost ratio (k + 1 tokens / one decode step) at which each task
    and method still reaches each speedup; None where even a free verification would not."""
    k = acceptance["num_speculative_tokens"]
    out = {}
    for task, methods in acceptance["tasks"].items():
        for name, m in methods.items():
            tokens = m["generated_tokens"] - m["num_prompts"]
            draft_cost = k * draft_cost_ratio if name.startswith("draft_model") else 0.0
            row = {}
            for goal in speedups:
                # tokens / (drafts * (c + draft_cost) + plain) >= goal
                budget = tokens / goal - m["plain_decode_steps"]
                c = budget / m["num_drafts"] - draft_cost if m["num_drafts"] else None
                row[f"max_verify_cost_for_{goal}x"] = round(c, 3) if c is not None and c > 0 else None
            out.setdefault(task, {})[name] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify-cost")
    v.add_argument("--context", type=int, default=512)
    v.add_argument("--repeats", type=int, default=20)
    v.add_argument("--model", default=None, help="a local model instead of the dummy Qwen2.5-7B (script check)")
    a = sub.add_parser("acceptance")
    a.add_argument("--num-prompts", type=int, default=8)
    a.add_argument("--max-tokens", type=int, default=64)
    a.add_argument("--work", default="/tmp/spec-bench", help="where the truncated draft checkpoint is written")
    a.add_argument("--drafts", nargs="*", default=[f"cut:{DRAFT_LAYERS}"],
                   help="draft models: a directory, or cut:N for tiny-qwen2's first N layers")
    a.add_argument("--ngram-min", type=int, default=2)
    a.add_argument("--ngram-max", type=int, default=4)
    j = sub.add_parser("project")
    j.add_argument("--verify-cost", default=None, help="verify-cost JSON; without it only the break-even costs")
    j.add_argument("--acceptance", required=True)
    j.add_argument("--draft-cost-ratio", type=float, default=0.1,
                   help="one draft forward / one target decode step (Qwen2.5-0.5B for a 7B INT4 target: ~0.1, "
                        "an assumption until measured)")
    for sp in (v, a, j):
        sp.add_argument("--out", default=None)
    args = p.parse_args()
    if args.command == "verify-cost":
        result = run_verify_cost(args)
    elif args.command == "acceptance":
        result = run_acceptance(args)
    else:
        acceptance = json.loads(Path(args.acceptance).read_text())
        result = {"break_even": break_even(acceptance, args.draft_cost_ratio)}
        if args.verify_cost:
            result.update(project(json.loads(Path(args.verify_cost).read_text()), acceptance, args.draft_cost_ratio))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
