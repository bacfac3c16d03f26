"""OpenAI-compatible request and response models. The OpenAI fields and the vLLM extras we implement are declared;
a field we do not implement is a 400 naming it unless its value asks for nothing (reject_unsupported), so no request
is silently answered as if it had not asked."""
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SEED_RANGE = (-2**63, 2**63 - 1)    # int64, as in vLLM; torch seeds take it (children add their index)
MAX_LOGPROBS = 20


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class APIError(Exception):
    """Raised by handlers; turned into the OpenAI error object with this status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"object": "error", "error": {"message": message, "type": type, "param": param, "code": code}}


# ---- requests ----------------------------------------------------------------------------------------------
_ANY = object()
# Fields OpenAI or vLLM define that this server does not implement, with the values that ask for nothing (accepted
# as if absent); any other value is a 400 naming the field. _ANY: the field does not change what is generated.
UNIMPLEMENTED_FIELDS: dict[str, object] = {
    # OpenAI
    "functions": (None, []), "function_call": (None, "none", "auto"), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "web_search_options": (None,), "reasoning_effort": (None,), "verbosity": (None,),
    "store": _ANY, "metadata": _ANY, "service_tier": _ANY, "prompt_cache_key": _ANY, "safety_identifier": _ANY,
    # vLLM extras (one grammar library here: the backend a request names does not change what it gets)
    "guided_decoding_backend": _ANY, "allowed_token_ids": (None,), "bad_words": (None, []),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0), "truncate_prompt_tokens": (None,), "prompt_logprobs": (None,),
    "spaces_between_special_tokens": (None, True), "priority": (None, 0), "logits_processors": (None,),
    "return_tokens_as_token_ids": (None, False), "documents": (None,), "mm_processor_kwargs": (None,),
    "cache_salt": (None,), "kv_transfer_params": (None,), "vllm_xargs": (None,), "echo": (None, False),
    "continuous_usage_stats": (None, False), "include_obfuscation": _ANY, "request_id": _ANY,
}


class OpenAIBaseModel(BaseModel):
    # Unknown fields are kept (not dropped) so that reject_unsupported can name them. Strict types, as OpenAI checks
    # them: "n": "2", "n": 2.0 or "echo": 1 are a 400, not quietly converted.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    def reject_unsupported(self, prefix: str = "") -> None:
        """400 for a field this model does not declare, unless UNIMPLEMENTED_FIELDS accepts its value. Checks the
        nested request models too (stream_options)."""
        for name, value in (self.model_extra or {}).items():
            accepted = UNIMPLEMENTED_FIELDS.get(name)
            if accepted is _ANY or (accepted is not None and value in accepted):
                continue
            param = prefix + name
            if accepted is None:
                raise APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
            raise APIError(400, f"{param}={value!r} is not supported by this server", param=param,
                           code="unsupported_parameter")
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, OpenAIBaseModel) and name != "messages":
                value.reject_unsupported(prefix=f"{prefix}{name}.")


def _unpaired_surrogate(value: Any, path: str) -> tuple[str, int] | None:
    """(path, index) of the first string under value (keys included) holding an unpaired UTF-16 surrogate, which
    JSON's \\uXXXX escapes can carry but no UTF-8 text (or tokenizer) can."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                return path, e.start
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")   # the error names it: no surrogate
            where = f"{path}.{name}" if path else name
            found = _unpaired_surrogate(key, where) or _unpaired_surrogate(item, where)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, (int, float)):
                found = _unpaired_surrogate(item, f"{path}.{i}")
                if found:
                    return found
    return None


class RequestModel(OpenAIBaseModel):
    """A request body: its strings must be valid Unicode (400 naming the parameter otherwise). The published schema
    lists only the declared fields (reject_unsupported refuses the rest, but for the values that ask for nothing)."""
    model_config = ConfigDict(json_schema_extra={"additionalProperties": False})

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        found = _unpaired_surrogate(data, "")
        if found:
            param, index = found
            raise APIError(400, f"{param} holds an unpaired UTF-16 surrogate at character {index}: strings must be "
                                "valid Unicode", param=param)
        return data


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class JsonSchemaFormat(OpenAIBaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None          # the schema is always enforced (by the grammar)


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class SamplingRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names, then vLLM extras)."""
    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    # vLLM's structured outputs: the guided_* fields, or structured_outputs {json | regex | choice | grammar | ...}
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def validate_request(self) -> None:
        """The checks pydantic cannot name a parameter for: 400 naming it."""
        self.reject_unsupported()
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options can only be given with stream=true", param="stream_options")


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    add_special_tokens: bool = True


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    """Fields beyond these (tool_calls, reasoning_content, ...) go to the chat template as the client sent them,
    as transformers and vLLM pass them."""
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None            # the client's own Jinja template (--allow-client-chat-template)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: either a prompt or chat messages."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None       # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbEntry(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatLogProbEntry] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str                 # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: dict[str, Any]          # {"role": "assistant", "content": ""} in a choice's first chunk, then content
    #                                or tool_calls: [{"index", "id", "type", "function": {"name", "arguments"}}, ...]
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
