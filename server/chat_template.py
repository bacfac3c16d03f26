"""Chat messages -> prompt token ids. Runs in the request thread pool (never on the event loop).

The model's template renders here; a client's own template (`chat_template`, `chat_template_kwargs.chat_template`)
only with --allow-client-chat-template, and then in a sandbox process (template_sandbox.py). Control tokens that a
client writes in any string (message content, names, template variables) are encoded as text, never as control
tokens: transformers' apply_chat_template(..., sanitize_control_tokens=True) marks them before rendering and encodes
them as plain text (transformers >= 5.20). With an older transformers such a string is refused instead.
"""
import inspect
import json
import re

from quant_serve.server.protocol import APIError, ChatMessage
from quant_serve.server.template_sandbox import ChatJob, TemplateRejected, TemplateSandbox


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the template reads them: text parts joined, fields beyond role/content/name passed through."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"content part type {part.type!r} is not supported (only text)",
                                   param=f"messages.{i}.content")
                parts.append(part.text)
            content = "\n".join(parts)
        message = {**(m.model_extra or {}), "role": m.role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_with_parsed_arguments(call, f"messages.{i}.tool_calls.{j}.function.arguments")
                                     for j, call in enumerate(message["tool_calls"])]
        out.append(message)
    return out


# Nesting the templates' tojson can write: deeper arguments reach Python's recursion limit inside the template.
MAX_ARGUMENTS_DEPTH = 64


def _with_parsed_arguments(call, param: str):
    """OpenAI sends a call's arguments as JSON text; chat templates (Qwen2.5, Llama 3.1, Mistral) write them with
    tojson and expect the object, as vLLM passes it. Text that is not JSON stays text; JSON that Python cannot hold
    (an integer past its int-string limit, nesting past its recursion limit) or nested deeper than
    MAX_ARGUMENTS_DEPTH is a 400 naming it."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    except (ValueError, RecursionError) as e:
        reason = "nested deeper than its recursion limit" if isinstance(e, RecursionError) else str(e).split(";")[0]
        raise APIError(400, f"{param} holds JSON this server cannot read: {reason}", param=param) from None
    if _depth(arguments) > MAX_ARGUMENTS_DEPTH:
        raise APIError(400, f"{param} nests JSON more than {MAX_ARGUMENTS_DEPTH} levels deep", param=param)
    return {**call, "function": {**function, "arguments": arguments}}


def _depth(value) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack += [(item, depth + 1) for item in (node.values() if isinstance(node, dict) else node)]
    return deepest


def _first_string_matching(value, pattern: re.Pattern, path: str) -> str | None:
    if isinstance(value, str):
        return path if pattern.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _first_string_matching(item, pattern, f"{path}.{key}")
        if found:
            return found
    return None


class ChatEncoder:
    def __init__(self, tokenizer, sandbox: TemplateSandbox | None = None):
        self.tokenizer = tokenizer
        self.sandbox = sandbox               # None: client templates are refused
        params = inspect.signature(tokenizer.apply_chat_template).parameters
        self.sanitizes = "sanitize_control_tokens" in params
        # apply_chat_template's own arguments (tokenize, return_dict, sanitize_control_tokens, tools, ...) are not
        # template variables: a client may not set them through chat_template_kwargs
        self.reserved = {name for name, p in params.items() if p.kind is not p.VAR_KEYWORD} - {"chat_template"}
        specials = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len,
                          reverse=True)
        self.control_tokens = re.compile("|".join(map(re.escape, specials)) or "(?!)")

    def encode(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False, chat_template: str | None = None,
               template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
        """Prompt token ids of the chat; APIError(400) naming the parameter for anything the client got wrong.
        tools: the request's tools (OpenAI objects), which the template renders (apply_chat_template's tools)."""
        kwargs = dict(template_kwargs or {})
        template, template_param = chat_template, "chat_template"
        if "chat_template" in kwargs:
            if template is not None:
                raise APIError(400, "give chat_template once", param="chat_template_kwargs.chat_template")
            template, template_param = kwargs.pop("chat_template"), "chat_template_kwargs.chat_template"
        if template is not None and self.sandbox is None:
            raise APIError(400, "this server renders only the model's chat template (start it with "
                                "--allow-client-chat-template to accept the client's)", param=template_param,
                           code="client_chat_template_not_allowed")
        if template is not None and not isinstance(template, str):
            raise APIError(400, "chat_template must be a string", param=template_param)
        for key in kwargs:
            if key in self.reserved:
                raise APIError(400, f"{key} is an argument of the server's template call, not a template variable",
                               param=f"chat_template_kwargs.{key}")
        if template is None and self.tokenizer.chat_template is None:
            raise APIError(400, "the model has no chat template; use /v1/completions", param="messages")
        if add_generation_prompt and continue_final_message:
            raise APIError(400, "add_generation_prompt and continue_final_message cannot both be true",
                           param="continue_final_message")
        chat = message_dicts(messages)
        if not self.sanitizes:
            found = _first_string_matching(chat, self.control_tokens, "messages") or \
                _first_string_matching(kwargs, self.control_tokens, "chat_template_kwargs")
            if found:
                raise APIError(400, f"{found} holds a control token of the model; this server's transformers cannot "
                                    "encode it as text (upgrade transformers to 5.20 or newer)", param=found)
        if tools:                            # checked above as a client variable; the server's own argument here
            kwargs["tools"] = tools
        if template is not None:
            job = ChatJob(chat, template, add_generation_prompt, continue_final_message, kwargs, self.sanitizes)
            try:
                return self.sandbox.encode(job)
            except TemplateRejected as e:
                raise APIError(400, str(e), param=template_param) from e
        return self._encode(chat, add_generation_prompt, continue_final_message, kwargs)

    def _encode(self, chat: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                kwargs: dict) -> list[int]:
        call = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                    **kwargs)
        try:
            if self.sanitizes:
                return list(self.tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False,
                                                               sanitize_control_tokens=True, **call))
            text = self.tokenizer.apply_chat_template(chat, tokenize=False, **call)
            return self.tokenizer.encode(text, add_special_tokens=False)
        except Exception as e:    # the template raised (jinja raise_exception, a bad role, a missing field)
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
