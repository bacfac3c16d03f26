"""Builds the shipped definition tasks in eval/tasks/ from held-out dictionary entries ({"word", "pos",
"definition"} JSONL, e.g. shared/data/val_definitions.jsonl). Deterministic for a given source and seed.

  python -m eval.build_tasks SOURCE.jsonl [--out eval/tasks] [--seed 0]

definitions.jsonl (multiple choice): context "WORD (pos):" in the dictionary-entry style of the training text, four
choices " definition": the entry's own and three drawn from other entries. definitions_gen.jsonl (generation):
the chat question 'What does "WORD" mean?'; the answer must be "WORD (pos)", the head of a dictionary-style reply
(generation stops at the ':' that follows it), so it checks that the model names the word and its part of speech.
"""
import argparse
import json
import random
from pathlib import Path

NUM_MC, NUM_GEN = 300, 200
MIN_DEF_CHARS, MAX_DEF_CHARS = 15, 150     # short enough to keep the file small, long enough to be informative


def load_entries(source: Path) -> list[dict]:
    rows = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in rows if r["pos"] and MIN_DEF_CHARS <= len(r["definition"]) <= MAX_DEF_CHARS]


def head(row: dict) -> str:
    return f"{row['word']} ({row['pos'].rstrip('.')})"


def build(rows: list[dict], seed: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    mc_rows, gen_rows = order[:NUM_MC], order[NUM_MC:NUM_MC + NUM_GEN]
    mc = []
    for i in mc_rows:
        row = rows[i]
        distractors: list[str] = []
        while len(distractors) < 3:
            other = rows[rng.randrange(len(rows))]
            if other["word"] != row["word"] and other["definition"] not in distractors + [row["definition"]]:
                distractors.append(other["definition"])
        choices = distractors + [row["definition"]]
        rng.shuffle(choices)
        mc.append({"context": head(row) + ":", "choices": [" " + c for c in choices],
                   "answer": choices.index(row["definition"])})
    gen = [{"prompt": f'What does "{rows[i]["word"]}" mean?', "chat": True, "answer": head(rows[i]),
            "stop": [":", "\n"], "max_tokens": 16} for i in gen_rows]
    return mc, gen


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "tasks")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    mc, gen = build(load_entries(args.source), args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, items in (("definitions.jsonl", mc), ("definitions_gen.jsonl", gen)):
        (args.out / name).write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
        print(f"wrote {len(items)} items to {args.out / name}")


if __name__ == "__main__":
    main()
