"""Task accuracy through the engine: multiple choice by log-likelihood, and exact-match generation.

Multiple choice (JSONL rows {"context", "choices": [...], "answer": index}): each choice is scored as the sum of the
log-probabilities of its tokens after the context (lm-eval's split: encode context and context + choice, the tail is
the continuation). `acc` picks the largest sum, `acc_norm` the largest sum per character of the choice.
Generation (rows {"prompt", "answer", optional "chat": bool, "stop": [...], "max_tokens": int}): greedy decoding;
correct when the output, stripped, equals the answer, stripped. "chat": true wraps the prompt as one user turn in
the model's chat template. Shipped tasks live in eval/tasks/ and are named by their file stem.
"""
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from quant_serve.engine.sampling_params import SamplingParams

logger = logging.getLogger("quant_serve")

SHIPPED_TASKS = Path(__file__).parent / "tasks"
DEFAULT_TASKS = ("definitions", "definitions_gen")
MULTIPLE_CHOICE, GENERATION = "multiple_choice", "generation"


@dataclass
class Task:
    name: str
    kind: str
    items: list[dict]
    path: str


@dataclass
class TaskResult:
    name: str
    kind: str
    correct: list[bool]                    # the task's primary metric, per item
    correct_sum: list[bool] | None = None  # multiple choice: unnormalized log-likelihood (acc)

    @property
    def metric(self) -> str:
        return "acc_norm" if self.kind == MULTIPLE_CHOICE else "exact_match"

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct) if self.correct else float("nan")

    def summary(self) -> dict:
        low, high = wilson_interval(sum(self.correct), len(self.correct))
        out = {"kind": self.kind, "metric": self.metric, "accuracy": self.accuracy, "ci95": [low, high],
               "num_items": len(self.correct)}
        if self.correct_sum is not None:
            out["acc"] = sum(self.correct_sum) / len(self.correct_sum)
        return out


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (sane at small n and at 0% / 100%)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def resolve_task_path(spec: str) -> Path:
    path = Path(spec)
    if path.is_file():
        return path
    shipped = SHIPPED_TASKS / f"{spec}.jsonl"
    if shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in SHIPPED_TASKS.glob("*.jsonl")))
    raise FileNotFoundError(f"task {spec!r} is neither a JSONL file nor a shipped task ({names})")


def load_task(spec: str, limit: int | None = None) -> Task:
    path = resolve_task_path(spec)
    items = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from e
    if not items:
        raise ValueError(f"{path}: no items")
    items = items[:limit] if limit else items
    kind = MULTIPLE_CHOICE if "choices" in items[0] else GENERATION
    for i, item in enumerate(items):
        _validate(item, kind, f"{path} item {i}")
    return Task(path.stem, kind, items, str(path))


def _validate(item: dict, kind: str, where: str) -> None:
    if kind == MULTIPLE_CHOICE:
        if not isinstance(item.get("context"), str) or not isinstance(item.get("choices"), list):
            raise ValueError(f"{where}: a multiple-choice item needs 'context' (string) and 'choices' (list)")
        if len(item["choices"]) < 2 or not all(isinstance(c, str) and c for c in item["choices"]):
            raise ValueError(f"{where}: 'choices' must hold at least two non-empty strings")
        if not isinstance(item.get("answer"), int) or not 0 <= item["answer"] < len(item["choices"]):
            raise ValueError(f"{where}: 'answer' must be an index into 'choices'")
    elif not isinstance(item.get("prompt"), str) or not isinstance(item.get("answer"), str):
        raise ValueError(f"{where}: a generation item needs 'prompt' and 'answer' strings "
                         "(or 'context', 'choices', 'answer' for multiple choice)")


def run_task(engine, task: Task, desc: str, lora_name: str | None = None) -> TaskResult:
    """lora_name: every prompt under that LoRA adapter (eval --lora)."""
    if task.kind == MULTIPLE_CHOICE:
        return run_multiple_choice(engine, task, desc, lora_name)
    return run_generation(engine, task, desc, lora_name)


def choice_scores(engine, items: list[dict], lora_name: str | None = None) -> list[list[float]]:
    """Per item, per choice: sum of log p(choice tokens | context, earlier choice tokens)."""
    tok = engine.tokenizer
    prompts, spans = [], []
    for item in items:
        context_len = len(tok.encode(item["context"]))
        for choice in item["choices"]:
            ids = tok.encode(item["context"] + choice)
            if len(ids) <= context_len:
                raise ValueError(f"choice {choice!r} adds no tokens after its context {item['context']!r}")
            prompts.append(ids)
            spans.append((context_len, len(ids)))
    # prompt_logprobs gives log p(token | prefix) for every prompt token, batched by the scheduler.
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, lora_name=lora_name)
    outputs = engine.generate(prompts, params, use_tqdm=True)
    flat = []
    for out, (begin, end) in zip(outputs, spans):
        lps = out.prompt_logprobs
        if lps is None or len(lps) != end:
            raise RuntimeError(f"engine returned {len(lps or [])} prompt logprobs for a {end}-token prompt")
        flat.append(sum(lp.logprob for lp in lps[begin:end]))
    scores, k = [], 0
    for item in items:
        scores.append(flat[k:k + len(item["choices"])])
        k += len(item["choices"])
    return scores


def run_multiple_choice(engine, task: Task, desc: str, lora_name: str | None = None) -> TaskResult:
    logger.info("task %s [%s]: %d items", task.name, desc, len(task.items))
    correct_norm, correct_sum = [], []
    for item, s in zip(task.items, choice_scores(engine, task.items, lora_name)):
        norm = [v / len(c) for v, c in zip(s, item["choices"])]
        correct_sum.append(max(range(len(s)), key=s.__getitem__) == item["answer"])
        correct_norm.append(max(range(len(s)), key=norm.__getitem__) == item["answer"])
    return TaskResult(task.name, MULTIPLE_CHOICE, correct_norm, correct_sum)


def run_generation(engine, task: Task, desc: str, lora_name: str | None = None) -> TaskResult:
    tok = engine.tokenizer
    prompts, params = [], []
    for item in task.items:
        prompt = item["prompt"]
        if item.get("chat"):
            prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(prompt)
        params.append(SamplingParams(max_tokens=item.get("max_tokens", 32), temperature=0.0,
                                     stop=item.get("stop", ["\n"]), lora_name=lora_name))
    logger.info("task %s [%s]: %d prompts", task.name, desc, len(prompts))
    outputs = engine.generate(prompts, params, use_tqdm=True)
    correct = [out.outputs[0].text.strip() == item["answer"].strip() for out, item in zip(outputs, task.items)]
    return TaskResult(task.name, GENERATION, correct)
