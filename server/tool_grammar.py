"""Grammars that force tool calls (tool_choice "required" or a named function) in the model's own format: a Lark
grammar (llguidance's dialect) whose calls are JSON schemas of {"name": <the function>, <arguments key>: <its
parameters>}, so the output always parses into calls of the given functions with valid arguments."""
import json

from quant_serve.engine.sample.structured import JSON_LAYOUT, close_objects
from quant_serve.server.tool_parsers import ToolCallFormat

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def call_schema(fmt: ToolCallFormat, function: dict) -> dict:
    """The JSON schema of one call. The parameters' $defs move to the root, where their "#/$defs/..." refs point."""
    parameters = close_objects(function.get("parameters") or EMPTY_PARAMETERS)
    defs = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, fmt.arguments_key: parameters},
            "required": ["name", fmt.arguments_key], "additionalProperties": False, "x-guidance": JSON_LAYOUT,
            **defs}


def _literal(text: str, tokenizer) -> str:
    """A Lark literal; a special token of the tokenizer as that token (<[id]>), which text cannot produce."""
    special = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return f"<[{special[text]}]>" if text in special else json.dumps(text)


def tool_call_grammar(fmt: ToolCallFormat, functions: list[dict], parallel: bool, tokenizer,
                      answer: dict | None = None) -> str:
    """Lark text: one call (or, with parallel, one or more) of the given functions; with answer (a JSON schema), that
    JSON instead of calls is allowed too (tool_choice auto with a JSON response_format)."""
    lines = [f"fn_{i}: %json {json.dumps(call_schema(fmt, f))}" for i, f in enumerate(functions)]
    one = " | ".join(f"fn_{i}" for i in range(len(functions)))
    parts = [json.dumps(fmt.call_open)] if fmt.call_open else []
    parts += [f"({one})"] + ([json.dumps(fmt.call_close)] if fmt.call_close else [])
    lines.insert(0, "call: " + " ".join(parts))
    calls = f"call ({json.dumps(fmt.call_separator)} call)*" if parallel else "call"
    prefix = [p for p in (fmt.grammar_marker and _literal(fmt.grammar_marker, tokenizer),
                          fmt.list_open and json.dumps(fmt.list_open)) if p]
    suffix = [json.dumps(fmt.list_close)] if fmt.list_close else []
    lines.insert(0, "calls: " + " ".join(prefix + [calls] + suffix))
    if answer is not None:
        lines.insert(0, "start: calls | answer")
        lines.append(f"answer: %json {json.dumps({**close_objects(answer), 'x-guidance': JSON_LAYOUT})}")
    else:
        lines.insert(0, "start: calls")
    return "\n".join(lines) + "\n"
