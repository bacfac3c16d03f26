"""What a structured-outputs constraint may ask for (issue 54): our own limits, checked before the grammar library
sees the constraint, so that what it cannot take is a 400 at request time and never a 200 whose output breaks it.

The limits follow OpenAI's documented structured-output limits (at most 5,000 object properties, 10 levels of
nesting, 1,000 enum values in a schema), lowered where llguidance's cost says so: a JSON object's optional
properties compile in time quadratic in their number (1,000 in 0.2 s, 5,000 in 6 s on this CPU, 10,000 in 33 s on
the reporter's host) and each one is about four Earley items in the parser's row after "{", whose width is capped
(max_items_in_row). A schema must also have a finite instance: a $ref cycle that every instance has to follow
forever ({"$ref": "#"}, a required property of the schema's own type) leaves the grammar with nothing to end on.
"""
from dataclasses import dataclass

# A JSON document nested deeper than this is refused before any recursive walk (Python's recursion limit is 1,000).
MAX_WALK_DEPTH = 64
# Schema keywords whose value is one schema, a list of schemas or a map of name -> schema.
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# descending through these is one more level of JSON nesting (an object's value, an array's item)
_NESTING = {"properties", "patternProperties", "additionalProperties", "items", "prefixItems", "contains",
            "additionalItems", "unevaluatedProperties", "unevaluatedItems"}


@dataclass(frozen=True)
class StructuredLimits:
    max_schema_chars: int = 100_000      # a JSON schema's text (OpenAI: 120,000 characters of names and values)
    max_properties: int = 1_000          # object properties in one schema, all objects together (OpenAI: 5,000)
    max_depth: int = 10                  # levels of object / array nesting (OpenAI: 10)
    max_enum_values: int = 1_000         # enum values in one schema, all enums together (OpenAI: 1,000)
    max_choices: int = 1_000             # guided_choice items
    max_choice_chars: int = 100_000      # guided_choice text, all items together
    max_regex_chars: int = 10_000
    max_grammar_chars: int = 500_000     # Lark / GBNF text (a tool list's grammar embeds every tool's schema)
    compile_budget_s: float = 10.0       # wall clock for one compilation, off the event loop
    max_items_in_row: int = 5_000        # llguidance's parser row width (default 2,000): 1,000 optional properties
    probe_steps: int = 64                # forced tokens followed from the start when a grammar is compiled

    def parser_limits(self):
        """llguidance's limits: the row width above; no grammar text in error messages (they reach logs and
        clients); the lexer and parser fuel stay at llguidance's defaults, which bound the work of a compilation and
        of each mask, so that a compilation past our budget still ends by itself."""
        import llguidance
        return llguidance.LLParserLimits(max_items_in_row=self.max_items_in_row, verbose_errors=False)


DEFAULT_LIMITS = StructuredLimits()


def short(message: str, limit: int = 300) -> str:
    """An error of the grammar library, fit for a log line and a client: one paragraph, at most `limit` characters
    (its verbose form quotes the whole grammar)."""
    text = " ".join(message.replace("<non-verbose/>", "").split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass
class _Counts:
    properties: int = 0
    enum_values: int = 0
    depth: int = 0


def check_schema(schema, limits: StructuredLimits = DEFAULT_LIMITS, text_chars: int = 0) -> None:
    """ValueError naming the limit a JSON schema (dict or bool, already parsed) goes past, or why it has no finite
    instance. text_chars: the length of its JSON text."""
    counts = _Counts()
    _walk(schema, 0, 0, counts, limits)
    if counts.properties > limits.max_properties:
        raise ValueError(f"the JSON schema has {counts.properties} object properties; the limit is "
                         f"{limits.max_properties}")
    if counts.enum_values > limits.max_enum_values:
        raise ValueError(f"the JSON schema has {counts.enum_values} enum values; the limit is "
                         f"{limits.max_enum_values}")
    if text_chars > limits.max_schema_chars:
        raise ValueError(f"the JSON schema is {text_chars} characters long; the limit is {limits.max_schema_chars}")
    if not has_finite_instance(schema):
        raise ValueError("the JSON schema has no finite instance: every instance would have to follow a $ref cycle "
                         "forever (a $ref to itself, or a required property, a non-empty array or every alternative "
                         "leading back to its own schema)")


def _walk(node, structure: int, depth: int, counts: _Counts, limits: StructuredLimits) -> None:
    if structure > MAX_WALK_DEPTH:
        raise ValueError(f"the JSON schema is nested more than {MAX_WALK_DEPTH} levels deep")
    if isinstance(node, list):
        for item in node:
            _walk(item, structure + 1, depth, counts, limits)
        return
    if not isinstance(node, dict):
        return
    if depth > limits.max_depth:
        raise ValueError(f"the JSON schema nests objects and arrays more than {limits.max_depth} levels deep")
    if isinstance(node.get("properties"), dict):
        counts.properties += len(node["properties"])
    if isinstance(node.get("enum"), list):
        counts.enum_values += len(node["enum"])
    for key in _ONE + _LIST + _MAP:
        if key not in node:
            continue
        value, inner = node[key], depth + (key in _NESTING)
        if key in _MAP and isinstance(value, dict):
            # a definition is reached through $ref from anywhere: its levels count from the root
            for item in value.values():
                _walk(item, structure + 1, 0 if key in ("$defs", "definitions") else inner, counts, limits)
        elif key in _LIST and isinstance(value, list):
            for item in value:
                _walk(item, structure + 1, inner, counts, limits)
        else:
            _walk(value, structure + 1, inner, counts, limits)


def _resolve(root, ref: str):
    """The schema a local $ref ("#", "#/$defs/a", "#/properties/x/items") points at; None for anything else."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _refs(node, found: set[str], structure: int = 0) -> None:
    if structure > MAX_WALK_DEPTH:
        return
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            found.add(node["$ref"])
        for value in node.values():
            _refs(value, found, structure + 1)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found, structure + 1)


def has_finite_instance(root) -> bool:
    """Whether some finite JSON value can satisfy the schema, as far as its structure tells (types, required
    properties, minItems, anyOf / oneOf / allOf and local $refs); keywords it does not model count as satisfiable.
    The least fixed point over the $ref targets: each starts unsatisfiable and becomes satisfiable once a finite
    instance is found for it without going through itself."""
    refs: set[str] = set()
    _refs(root, refs)
    known = {ref: False for ref in refs}
    for _ in range(len(known) + 1):
        changed = False
        for ref in known:
            target = _resolve(root, ref)
            value = True if target is None else _finite(target, known, 0)   # remote refs: llguidance decides
            if value != known[ref]:
                known[ref], changed = value, True
        if not changed:
            break
    return _finite(root, known, 0)


def _finite(node, known: dict[str, bool], structure: int) -> bool:
    if node is False:
        return False
    if not isinstance(node, dict) or structure > MAX_WALK_DEPTH:
        return True
    if "$ref" in node and not known.get(node["$ref"], True):
        return False
    if "allOf" in node and isinstance(node["allOf"], list) and \
            not all(_finite(s, known, structure + 1) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and not any(_finite(s, known, structure + 1) for s in node[key]):
            return False
    if "const" in node or "enum" in node:
        return bool(node.get("enum", [None]))
    types = node.get("type")
    types = types if isinstance(types, list) else [types] if types else []
    if len(types) > 1:      # another type than the one that recurses may be chosen
        return True
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    if types == ["object"] or (not types and properties):
        for name in node.get("required") or []:
            schema = properties.get(name, node.get("additionalProperties", True))
            if not _finite(schema, known, structure + 1):
                return False
    if types == ["array"] or (not types and ("items" in node or "prefixItems" in node)):
        min_items = node.get("minItems", 0) if isinstance(node.get("minItems", 0), int) else 0
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        needed = prefix[:min_items] + ([node.get("items", True)] if min_items > len(prefix) else [])
        if not all(_finite(s, known, structure + 1) for s in needed):
            return False
    return True
