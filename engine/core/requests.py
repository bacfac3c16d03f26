"""A request's checks before it is queued: its prompt as token ids inside the vocabulary, a length that leaves room
for a generated token, and sampling values the engine can honour."""
from quant_serve.engine.sampling_params import SamplingParams


def encode_prompt(tokenizer, vocab_size: int, prompt: str | list[int]) -> tuple[str | None, list[int]]:
    """-> (the prompt's text or None, its token ids)."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt, add_special_tokens=True)
    ids = list(prompt)
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    return None, ids


def check_request(num_prompt_tokens: int, params: SamplingParams, max_model_len: int, vocab_size: int) -> None:
    if num_prompt_tokens == 0:
        raise ValueError("the prompt is empty: at least one token is needed")
    if num_prompt_tokens >= max_model_len:
        raise ValueError(f"the prompt has {num_prompt_tokens} tokens, but max_model_len is "
                         f"{max_model_len}: it must leave room for at least one generated token")
    outside = [t for t in params.logit_bias or {} if t >= vocab_size]
    if outside:
        raise ValueError(f"logit_bias token id {outside[0]} is outside the vocabulary [0, {vocab_size})")
