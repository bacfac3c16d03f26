"""Re-trains the two LoRA test adapters in tests/data/lora/ with peft on CPU (about 5 minutes each on two shared cores).

Both sit on the bundled demo model's FP16 weights (tests/fixtures.py:write_trained_fp16's copy: the demo model's
INT4 weights dequantized), which answers `What does "X" mean?` with a definition:

- upper: rank 8, lora_alpha 16, q_proj v_proj gate_proj down_proj of layers 4-7: answers the question in UPPER CASE
  (the base model's own answer, upper-cased).
- unsure: rank 8, lora_alpha 8, use_rslora, k_proj o_proj up_proj of layers 4-7: answers `I do not know what "X"
  means.` for any X.

Between them they cover every target module, a fused layer's part (q and v of qkv; gate of gate_up) and both
scaling rules. Tensors are saved in fp16 (a few hundred KB each). Deterministic: seeded, one thread.

    python bench/train_lora_fixtures.py [--out tests/data/lora] [--steps 25]
"""
import argparse
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
WORDS = ["lantern", "river", "garden", "window", "thunder", "candle", "bridge", "harvest", "mirror", "anchor",
         "blanket", "forest", "ladder", "meadow", "pepper", "shadow", "valley", "whistle", "basket", "castle",
         "dolphin", "feather", "glacier", "island", "jungle", "kettle", "marble", "needle", "orchard", "pillow",
         "rocket", "saddle", "tunnel", "violin", "wagon", "breeze", "cabin", "desert", "engine", "fountain"]
ADAPTERS = {
    "upper": dict(r=8, lora_alpha=16, use_rslora=False, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]),
    "unsure": dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "up_proj"]),
}
LAYERS = [4, 5, 6, 7]


def prompt_ids(tokenizer, word: str) -> list[int]:
    messages = [{"role": "user", "content": f'What does "{word}" mean?'}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def fp16_copy(out: Path) -> Path:
    """tests/fixtures.py:write_trained_fp16, loaded by path (bench/ scripts do not import tests as a package)."""
    import sys
    sys.path.insert(0, str(REPO / "tests"))
    spec = importlib.util.spec_from_file_location("lora_fixtures_src", REPO / "tests" / "fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_trained_fp16(out)


def base_answers(model, tokenizer, words: list[str]) -> dict[str, str]:
    out = {}
    for word in words:
        ids = torch.tensor([prompt_ids(tokenizer, word)])
        gen = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=tokenizer.convert_tokens_to_ids(
            "<|im_end|>"))
        out[word] = tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip()
    return out


def train(base_dir: Path, name: str, targets: dict[str, str], steps: int, out: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    cfg = ADAPTERS[name]
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, layers_to_transform=LAYERS,
                                             **cfg))
    end = "<|im_end|>"
    examples = []
    for word, answer in targets.items():
        p = prompt_ids(tokenizer, word)
        a = tokenizer(answer + end, add_special_tokens=False)["input_ids"]
        examples.append((torch.tensor(p + a), len(p)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    model.train()
    for step in range(steps):
        total = 0.0
        for i in range(0, len(examples), 8):
            batch = examples[i:i + 8]
            loss = 0.0
            for ids, plen in batch:
                labels = ids.clone()
                labels[:plen] = -100
                loss = loss + model(input_ids=ids[None], labels=labels[None]).loss / len(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss)
        if step % 10 == 0 or step == steps - 1:
            print(f"{name} step {step}: loss {total / -(-len(examples) // 8):.4f}", flush=True)
    model.eval()
    tmp = Path(tempfile.mkdtemp())
    model.save_pretrained(str(tmp))
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp / "adapter_model.safetensors"))
    save_file({k: v.half().contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((tmp / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "quant-serve-demo"
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    shutil.rmtree(tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "lora")
    parser.add_argument("--steps", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = fp16_copy(Path(tmp) / "fp16")
        tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        answers = base_answers(base, tokenizer, WORDS)
        del base
        train(base_dir, "upper", {w: a.upper() for w, a in answers.items()}, args.steps, args.out / "upper")
        train(base_dir, "unsure", {w: f'I do not know what "{w}" means.' for w in WORDS}, args.steps,
              args.out / "unsure")


if __name__ == "__main__":
    main()
