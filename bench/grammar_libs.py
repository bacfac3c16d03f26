"""The measurement behind the grammar library choice (engine/sample/structured.py): xgrammar vs llguidance on CPU.

For one JSON schema (8 required fields: strings, a pattern, an enum, an array, a nested object, numbers) and a
tokenizer: the compile time of a new schema, the mask time per token along a valid document, the time to fill the
masks of 64 matchers at different positions (one call, the library's thread pool), and the time to apply 64 masks to
[64, vocab] fp32 logits on the CPU (each library's function and the sampler's, engine/sample/structured_mask.py).

    python bench/grammar_libs.py                                   # the demo model's tokenizer (8192 tokens)
    python bench/grammar_libs.py --out bench/results/grammar-libs-cpu.json
    python bench/grammar_libs.py --tokenizer DIR --vocab-size N --label TEXT --out FILE
"""
import argparse
import json
import statistics
import time
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import AutoTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string"},
                                                      "city": {"type": "string"}},
                    "required": ["street", "city"], "additionalProperties": False},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "role", "tags", "address", "active", "score"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@math.uk", "role": "admin",
            "tags": ["math", "engines", "poetry"], "address": {"street": "12 St James's Square", "city": "London"},
            "active": True, "score": 98.5}
BATCH = 64
REPEAT = 20


def timed(fn, repeat: int = 1) -> float:
    """Mean seconds of fn() over repeat calls."""
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def schemas(count: int) -> list[str]:
    """Distinct schemas (a title each), so no library answers from a cache."""
    return [json.dumps({**SCHEMA, "title": f"T{i}"}) for i in range(count)]


def measure_xgrammar(tok, vocab: int, eos: int, ids: list[int]) -> dict:
    import xgrammar as xgr
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    result = {"version": version("xgrammar"), "tokenizer_s": time.perf_counter() - start}
    compiled = []
    result["compile_ms"] = [timed(lambda s=s: compiled.append(compiler.compile_json_schema(s))) * 1e3
                            for s in schemas(5)]
    matcher, mask, per_token = xgr.GrammarMatcher(compiled[0]), xgr.allocate_token_bitmask(1, vocab), []
    for t in ids:
        per_token.append(timed(lambda: matcher.fill_next_token_bitmask(mask, 0)))
        assert matcher.accept_token(t)
    matcher.fill_next_token_bitmask(mask, 0)
    assert matcher.accept_token(eos) and matcher.is_terminated()
    result["mask_us_mean"], result["mask_us_max"] = statistics.mean(per_token) * 1e6, max(per_token) * 1e6
    matchers = [xgr.GrammarMatcher(compiled[0]) for _ in range(BATCH)]
    for j, m in enumerate(matchers):
        assert all(m.accept_token(t) for t in ids[:j % len(ids)])
    masks, batch = xgr.allocate_token_bitmask(BATCH, vocab), xgr.BatchGrammarMatcher()
    result["batch_fill_ms"] = timed(lambda: batch.batch_fill_next_token_bitmask(matchers, masks), REPEAT) * 1e3
    logits = torch.randn(BATCH, vocab)
    result["apply_ms"] = timed(lambda: xgr.apply_token_bitmask_inplace(logits, masks), REPEAT) * 1e3
    return result, masks


def measure_llguidance(tok, vocab: int, eos: int, ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt
    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
    result = {"version": version("llguidance"), "tokenizer_s": time.perf_counter() - start}
    grammars = []

    def compile_one(s):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(s)
        assert not llguidance.LLMatcher.validate_grammar(grammar, lltok)
        grammars.append(grammar)
    result["compile_ms"] = [timed(lambda s=s: compile_one(s)) * 1e3 for s in schemas(5)]
    matcher, mask, per_token = llguidance.LLMatcher(lltok, grammars[0]), llt.allocate_token_bitmask(1, vocab), []
    for t in ids:
        per_token.append(timed(lambda: llt.fill_next_token_bitmask(matcher, mask, 0)))
        assert matcher.consume_token(t), matcher.get_error()
    llt.fill_next_token_bitmask(matcher, mask, 0)
    assert matcher.is_accepting() and matcher.consume_token(eos) and matcher.is_stopped()
    result["mask_us_mean"], result["mask_us_max"] = statistics.mean(per_token) * 1e6, max(per_token) * 1e6
    matchers = [llguidance.LLMatcher(lltok, grammars[0]) for _ in range(BATCH)]
    for j, m in enumerate(matchers):
        assert m.consume_tokens(ids[:j % len(ids)])
    masks, executor = llt.allocate_token_bitmask(BATCH, vocab), llguidance.LLExecutor()
    rows = [(m, j) for j, m in enumerate(matchers)]
    result["batch_fill_ms"] = timed(lambda: llt.fill_next_token_bitmask_par(executor, rows, masks), REPEAT) * 1e3
    logits = torch.randn(BATCH, vocab)
    llt.apply_token_bitmask_inplace(logits, masks)           # its first call compiles (torch.compile)
    result["apply_ms"] = timed(lambda: llt.apply_token_bitmask_inplace(logits, masks), REPEAT) * 1e3
    return result, masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = Path(__file__).resolve().parents[1]
    parser.add_argument("--tokenizer", default=str(here / "engine" / "load" / "demo_model"))
    parser.add_argument("--vocab-size", type=int, default=None, help="the model's (default: the tokenizer's)")
    parser.add_argument("--eos", default="<|im_end|>")
    parser.add_argument("--label", default=None, help="what the tokenizer is, for the JSON (default: its path)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = args.vocab_size or len(tok)
    eos = tok.convert_tokens_to_ids(args.eos)
    ids = tok.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    result = {"tokenizer": args.label or args.tokenizer, "vocab_size": vocab, "document_tokens": len(ids),
              "batch": BATCH, "torch": torch.__version__}
    result["xgrammar"], _ = measure_xgrammar(tok, vocab, eos, ids)
    result["llguidance"], masks = measure_llguidance(tok, vocab, eos, ids)
    from quant_serve.engine.sample.structured_mask import apply_bitmask
    logits = torch.randn(BATCH, vocab)
    result["quant_serve_apply_ms"] = timed(lambda: apply_bitmask(logits, masks.numpy()), REPEAT) * 1e3
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
