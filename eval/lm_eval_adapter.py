"""lm-eval (EleutherAI lm-evaluation-harness) tasks against quant-serve, two ways. Needs `pip install lm-eval`.

1. Against a running server (`quant-serve serve`), with lm-eval's own `local-completions` client. This module only
   builds the command line; it launches nothing:
       lm_eval run --model local-completions --model_args model=NAME,base_url=http://HOST:PORT/v1/completions,\
tokenizer_backend=auto,max_length=2048,num_concurrent=8,max_retries=3 --tasks hellaswag
   (local_completions_command() returns that argv; the server's tokenizer endpoints spare a local tokenizer.)
2. In process, without a server: the LM class `QuantServeLM`, registered with lm-eval as "quant-serve", drives
   LLMEngine directly (the same path as `quant-serve eval`):
       python -m eval.lm_eval_adapter run --model quant-serve --model_args model=DIR,device=cpu --tasks hellaswag
   or from Python: register(); lm_eval.simple_evaluate(model="quant-serve", model_args="model=DIR", tasks=[...]).
Without lm-eval installed this module still imports; register() and quant_serve_lm_class() raise ImportError.
"""
import sys

from quant_serve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from quant_serve.engine.sampling_params import SamplingParams

MODEL_NAME = "quant-serve"


def local_completions_command(base_url: str, model: str, tasks: list[str], max_length: int = 2048,
                              num_concurrent: int = 8, extra: list[str] = ()) -> list[str]:
    """argv for lm-eval's local-completions against a quant-serve server at base_url (e.g. http://127.0.0.1:8000)."""
    model_args = (f"model={model},base_url={base_url.rstrip('/')}/v1/completions,tokenizer_backend=auto,"
                  f"max_length={max_length},num_concurrent={num_concurrent},max_retries=3")
    return ["lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
            "--tasks", ",".join(tasks), *extra]


def quant_serve_lm_class():
    """The LM subclass; built on demand so that importing this module does not need lm-eval."""
    from lm_eval.api.model import LM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class QuantServeLM(LM):
        def __init__(self, model: str, device: str = "auto", dtype: str = "auto", kv_cache_dtype: str = "auto",
                     max_model_len: int = 2048, max_num_seqs: int = 64, max_gen_toks: int = 256, **_ignored):
            super().__init__()
            from quant_serve.engine.llm_engine import LLMEngine
            cache = CacheConfig(num_gpu_blocks=max(4 * -(-int(max_model_len) // 16), 512),
                                kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
            self.engine = LLMEngine(EngineConfig(
                model=model, device=device, dtype=dtype, cache=cache,
                scheduler=SchedulerConfig(max_num_seqs=int(max_num_seqs), max_model_len=int(max_model_len))),
                show_progress=False)
            self.tokenizer = self.engine.tokenizer
            self.max_length = self.engine.max_model_len
            self.max_gen_toks = int(max_gen_toks)
            self.eot_token_id = self.tokenizer.eos_token_id

        def _continuation_logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
            """(context ids, continuation ids) -> (sum log p(continuation), whether it is the greedy choice)."""
            prompts = [(ctx + cont)[-self.max_length:] for ctx, cont in pairs]
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
            out = []
            for (_, cont), res in zip(pairs, self.engine.generate(prompts, params, use_tqdm=True)):
                lps = res.prompt_logprobs[-len(cont):]
                out.append((sum(lp.logprob for lp in lps), all(lp.top and lp.top[0][0] == lp.token_id for lp in lps)))
            return out

        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            pairs = []
            for context, continuation in (r.args for r in requests):
                whole = self.tokenizer.encode(context + continuation, add_special_tokens=False)
                ctx = self.tokenizer.encode(context, add_special_tokens=False) if context else []
                if not ctx:     # the first token needs something to condition on
                    ctx, whole = [self.eot_token_id], [self.eot_token_id] + whole
                pairs.append((whole[:len(ctx)], whole[len(ctx):]))
            return self._continuation_logprobs(pairs)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            out = []
            for (text,) in (r.args for r in requests):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    ids, self.eot_token_id, self.max_length, 1)]
                out.append(sum(lp for lp, _ in self._continuation_logprobs(windows)))
            return out

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            prompts, params = [], []
            for context, gen_kwargs in (r.args for r in requests):
                kwargs = dict(gen_kwargs or {})
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
                max_tokens = int(kwargs.get("max_gen_toks", self.max_gen_toks))
                ids = self.tokenizer.encode(context, add_special_tokens=False)[-(self.max_length - max_tokens):]
                prompts.append(ids)
                params.append(SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=until))
            return [r.outputs[0].text for r in self.engine.generate(prompts, params, use_tqdm=True)]

        @property
        def tokenizer_name(self) -> str:
            return self.tokenizer.name_or_path.replace("/", "__")

        def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
            return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)

        def chat_template(self, chat_template=False) -> str | None:
            return self.tokenizer.chat_template if chat_template else None

    return QuantServeLM


def register() -> type:
    """Register QuantServeLM with lm-eval as "quant-serve" (idempotent); returns the class."""
    from lm_eval.api.registry import get_model, register_model
    try:
        return get_model(MODEL_NAME)
    except (KeyError, ValueError):
        cls = quant_serve_lm_class()
        register_model(MODEL_NAME)(cls)
        return cls


def main() -> None:
    """`python -m eval.lm_eval_adapter ARGS`: lm-eval's own CLI with "quant-serve" registered."""
    register()
    from lm_eval.__main__ import cli_evaluate
    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
