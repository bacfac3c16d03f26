"""lm-eval's `local-completions` against a real server, with the server's tokenizer endpoints (no local tokenizer):
its loglikelihoods and accuracy equal what the engine computes offline, and its greedy generations equal ours."""
import json
import random
from pathlib import Path

import pytest
import torch

from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.eval.tasks import load_task
from helpers import make_engine
from server_common import running_server

TASKS = Path(__file__).parents[1] / "lm_eval_tasks"
NUM_MC_DOCS, NUM_GEN_DOCS, MAX_MODEL_LEN = 40, 8, 512


@pytest.fixture(scope="module")
def lm_eval():
    return pytest.importorskip("lm_eval", reason="lm-eval is not installed (it is in the `test` extra)")


@pytest.fixture(scope="module")
def server(tmp_path_factory, trained_model):
    args = [str(trained_model), "--num-gpu-blocks-override", "256", "--max-model-len", str(MAX_MODEL_LEN),
            "--dtype", "float32", "--served-model-name", "tiny"]
    with running_server(args, tmp_path_factory.mktemp("lm_eval") / "server.log") as s:
        yield s


def write_docs(directory: Path) -> tuple[list[dict], list[dict]]:
    # held-out dictionary entries: the shipped definitions task's words and right answers
    rows = [{"word": item["context"].rsplit(" (", 1)[0], "definition": item["choices"][item["answer"]].strip()}
            for item in load_task("definitions").items]
    rng = random.Random(1234)
    picked = rng.sample(rows, NUM_MC_DOCS + NUM_GEN_DOCS)
    mc_docs = []
    for row in picked[:NUM_MC_DOCS]:
        distractors = []
        while len(distractors) < 3:
            other = rng.choice(rows)["definition"][:100]
            if other not in distractors and other != row["definition"][:100]:
                distractors.append(other)
        choices = [row["definition"][:100]] + distractors
        rng.shuffle(choices)
        mc_docs.append({"word": row["word"], "choices": choices, "gold": choices.index(row["definition"][:100])})
    gen_docs = [{"word": r["word"], "definition": r["definition"]} for r in picked[NUM_MC_DOCS:]]
    for name, docs in (("qs_definitions.jsonl", mc_docs), ("qs_definitions_gen.jsonl", gen_docs)):
        (directory / name).write_text("".join(json.dumps(d) + "\n" for d in docs))
    return mc_docs, gen_docs


def offline_loglikelihood(engine, context: str, continuation: str) -> float:
    """As lm-eval splits a pair: encode context and context + continuation, the continuation is the tail."""
    context_ids = engine.tokenizer.encode(context, add_special_tokens=False)
    whole = engine.tokenizer.encode(context + continuation, add_special_tokens=False)
    logprobs = engine.score(whole).log_softmax(dim=-1)                       # row i predicts token i + 1
    positions = torch.arange(len(context_ids), len(whole))
    return logprobs[positions - 1, torch.tensor(whole)[positions]].sum().item()


def test_lm_eval_local_completions_matches_the_engine(lm_eval, server, tmp_path, monkeypatch, one_torch_thread,
                                                     trained_model):
    monkeypatch.chdir(tmp_path)          # the task YAMLs name their data files relative to the working directory
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mc_docs, gen_docs = write_docs(tmp_path)
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    lm = get_model("local-completions")(
        model="tiny", base_url=server.url + "/v1/completions", tokenizer_backend="auto", max_length=MAX_MODEL_LEN,
        batch_size=8, max_retries=1, timeout=120)
    assert lm.tokenizer_backend == "remote", "lm-eval should find /tokenizer_info and /tokenize"
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["qs_definitions", "qs_definitions_gen"], log_samples=True,
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False))

    engine = make_engine(trained_model, num_blocks=64, max_model_len=MAX_MODEL_LEN)
    samples = sorted(results["samples"]["qs_definitions"], key=lambda s: s["doc_id"])
    assert len(samples) == NUM_MC_DOCS
    correct = 0
    for sample, doc in zip(samples, mc_docs):
        assert sample["doc"]["word"] == doc["word"]
        context = f'Which definition belongs to "{doc["word"]}"?\nAnswer:'
        ours = [offline_loglikelihood(engine, context, " " + choice) for choice in doc["choices"]]
        theirs = [resp[0][0] for resp in sample["resps"]]
        assert theirs == pytest.approx(ours, abs=1e-4)
        correct += max(range(4), key=lambda i: ours[i]) == doc["gold"]
    assert results["results"]["qs_definitions"]["acc,none"] == correct / NUM_MC_DOCS

    gen = sorted(results["samples"]["qs_definitions_gen"], key=lambda s: s["doc_id"])
    assert len(gen) == NUM_GEN_DOCS
    prompts = [f'<|im_start|>user\nWhat does "{d["word"]}" mean?<|im_end|>\n<|im_start|>assistant\n'
               for d in gen_docs]
    ids = [engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    params = SamplingParams(max_tokens=24, temperature=0, stop=["\n", engine.tokenizer.eos_token])
    expected = [out.outputs[0].text for out in engine.generate(ids, params)]
    assert [s["resps"][0][0] for s in gen] == expected
    assert any(expected), "the model answers at least some definitions"
