"""The tool-call formats models are trained on, parsed back into OpenAI tool calls (whole or streamed as deltas) and
written as grammars (tool_grammar.py) when tool_choice forces a call.

hermes (Qwen2.5, Qwen3, Hermes):  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block per call
llama3_json (Llama 3.1 / 3.2):    {"name": ..., "parameters": {...}}, calls separated by "; "
mistral:                          [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

Markers that are special tokens ([TOOL_CALLS], <|python_tag|>) are dropped from the text by skip_special_tokens, so
the llama3_json and mistral parsers also take a call that opens the output without them. Arguments are returned as
the model wrote them (the raw JSON text of the value), so streamed argument deltas add up to the same string.
"""
import json
import re
import uuid
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder()
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    marker: str                    # text that opens the calls ("" : a call at the very start of the output)
    opens_at_start: str            # without the marker, a call may open the output with this character
    separators: tuple[str, ...]    # what may stand between the marker and the calls, and between calls
    arguments_key: str             # the key the model writes the arguments under
    # how the grammar writes forced calls (tool_grammar.py): marker, list_open, calls (call_open CALL call_close)
    # joined by call_separator, list_close
    grammar_marker: str = ""
    call_open: str = ""
    call_close: str = ""
    call_separator: str = ""
    list_open: str = ""
    list_close: str = ""


HERMES = ToolCallFormat("hermes", "<tool_call>", "", ("<tool_call>", "</tool_call>"), "arguments",
                        call_open="<tool_call>\n", call_close="\n</tool_call>", call_separator="\n")
LLAMA3_JSON = ToolCallFormat("llama3_json", "<|python_tag|>", "{", (";",), "parameters", call_separator="; ")
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS]", "[", ("[", "]", ","), "arguments", grammar_marker="[TOOL_CALLS]",
                         call_separator=", ", list_open="[", list_close="]")
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def detect_format(chat_template: str | None) -> ToolCallFormat:
    """The format a model's chat template teaches (hermes where it shows none: the most common one)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "parameters" in template):
        return LLAMA3_JSON
    return HERMES


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    name: str | None               # None until the model wrote it
    arguments: str | None          # raw JSON text so far (whole once complete); None before the key
    complete: bool
    end: int                       # where the call's object ends in the text (complete calls)


def _skip_separators(text: str, pos: int, fmt: ToolCallFormat) -> int:
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
            continue
        for sep in fmt.separators:
            if text.startswith(sep, pos):
                pos += len(sep)
                break
        else:
            return pos
    return pos


def _calls_start(text: str, fmt: ToolCallFormat) -> tuple[int | None, int]:
    """(where the calls begin, or None; how much of the text is surely content). The second value holds back a
    partial marker at the end of the text."""
    at = text.find(fmt.marker)
    if at != -1:
        return at, at
    stripped = len(text) - len(text.lstrip())
    if fmt.opens_at_start and text[stripped:stripped + 1] == fmt.opens_at_start:
        return stripped, 0
    if fmt.opens_at_start and stripped == len(text):
        return None, 0                            # only whitespace yet: a call may still open the output
    for keep in range(min(len(fmt.marker) - 1, len(text)), 0, -1):
        if fmt.marker.startswith(text[-keep:]):
            return None, len(text) - keep
    return None, len(text)


def scan_calls(text: str, start: int, fmt: ToolCallFormat) -> list[ParsedCall]:
    """The calls from `start` on: complete ones, then at most one the model is still writing. Stops at text that is
    not a call (the caller treats what follows as not a call)."""
    calls = []
    pos = start + len(fmt.marker) if text.startswith(fmt.marker, start) else start
    while True:
        pos = _skip_separators(text, pos, fmt)
        if pos >= len(text) or text[pos] != "{":
            return calls
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            calls.append(_partial_call(text, pos))
            return calls
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return calls
        key = _ARGUMENTS.search(text, pos, end)
        arguments = "{}"
        if key is not None:
            _, args_end = _DECODER.raw_decode(text, key.end())
            arguments = text[key.end():args_end]
        calls.append(ParsedCall(value["name"], arguments, True, end))
        pos = end


def _partial_call(text: str, pos: int) -> ParsedCall:
    """A call object still being written: its name once closed, the raw arguments written so far. The object is not
    complete, so a complete arguments value is followed by more keys at most: the value is cut at its end."""
    name = _NAME.search(text, pos)
    key = _ARGUMENTS.search(text, pos)
    arguments = None
    if key is not None:
        try:
            _, args_end = _DECODER.raw_decode(text, key.end())
            arguments = text[key.end():args_end]
        except json.JSONDecodeError:
            arguments = text[key.end():]
    return ParsedCall(json.loads(f'"{name.group(1)}"') if name else None, arguments, False, len(text))


def extract_tool_calls(text: str, fmt: ToolCallFormat) -> tuple[str | None, list[dict]]:
    """Finished output -> (content or None, OpenAI tool calls). Output whose calls do not parse is all content."""
    start, _ = _calls_start(text, fmt)
    calls = [] if start is None else [c for c in scan_calls(text, start, fmt) if c.complete]
    if not calls:
        return text, []
    content = text[:start].strip() or None
    return content, [{"id": new_call_id(), "type": "function",
                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


@dataclass
class ToolCallStream:
    """Turns one choice's streamed text into OpenAI deltas: content while no call opened, then for each call a first
    delta with its index, id, type and name, and argument text after it."""
    fmt: ToolCallFormat
    text: str = ""
    content_sent: int = 0
    sent: list[tuple[str, int]] = field(default_factory=list)     # per announced call: (id, argument chars sent)
    not_calls: bool = False        # what looked like a call at the start was not one: all of it is content

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content delta, tool call deltas) for newly generated text; final: the choice ended."""
        self.text += delta
        start, safe = (None, len(self.text)) if self.not_calls else _calls_start(self.text, self.fmt)
        if start is None:
            return self._content(len(self.text) if final else safe), []
        calls = scan_calls(self.text, start, self.fmt)
        if not calls and (final or self._not_a_call(start)):
            self.not_calls = True
            return self._content(len(self.text)), []
        content = self._content(start).rstrip() if start > self.content_sent else ""
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:
                break
            if index == len(self.sent):
                call_id = new_call_id()
                self.sent.append((call_id, 0))
                deltas.append({"index": index, "id": call_id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            call_id, done = self.sent[index]
            if call.arguments is not None and len(call.arguments) > done:
                deltas.append({"index": index, "function": {"arguments": call.arguments[done:]}})
                self.sent[index] = (call_id, len(call.arguments))
        return content, deltas

    def _content(self, upto: int) -> str:
        if upto <= self.content_sent:
            return ""
        out = self.text[self.content_sent:upto]
        self.content_sent = upto
        return out

    def _not_a_call(self, start: int) -> bool:
        """The text at start can no longer become a call (what opened the output is some other JSON or text)."""
        pos = _skip_separators(self.text, start + len(self.fmt.marker) if self.text.startswith(self.fmt.marker, start)
                               else start, self.fmt)
        if pos >= len(self.text):
            return False
        if self.text[pos] != "{":
            return True
        try:
            value, _ = _DECODER.raw_decode(self.text, pos)
        except json.JSONDecodeError:
            return False
        return not (isinstance(value, dict) and isinstance(value.get("name"), str))

    @property
    def called(self) -> bool:
        return bool(self.sent)
