"""What a request asks its output to match: vLLM's StructuredOutputsParams, and OpenAI's
response_format turned into one.

Exactly one kind is given: a JSON Schema (`json`), any JSON object (`json_object`), a regular
expression (`regex`, Rust regex syntax), one of several strings (`choice`), or a grammar
(`grammar`: Lark as llguidance reads it, or GBNF / EBNF as llama.cpp writes it). Each becomes one
llguidance grammar text (grammar_text), which jaxsched/structured/grammar.py compiles and turns into token
masks. Plain Python: nothing here imports llguidance until a grammar is built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jaxsched.core.limits import MAX_CHOICES, MAX_GRAMMAR_CHARS
from jaxsched.errors import InvalidRequestError

PARAM = "structured_outputs"
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Whitespace JSON output may put between two tokens: any JSON whitespace, up to 16 characters
# (pretty printing three or four levels deep). Unbounded, a model that starts repeating a newline
# or a tab (small models do, under greedy decoding) can never leave it and runs to max_tokens.
# disable_any_whitespace gives compact JSON; whitespace_pattern any other rule.
DEFAULT_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams. `json` is a schema (a dict, or its JSON text); the object
    keeps its text, so that the params stay hashable and the schema's key order (the order the
    output writes properties in) is kept."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise InvalidRequestError(f"structured outputs take exactly one of {', '.join(KINDS)}; got {what}",
                                      PARAM)
        too_deep = InvalidRequestError("structured_outputs.json is nested too deeply to read: send a flatter "
                                       "schema (use $defs and $ref for repeated parts)", f"{PARAM}.json")
        if isinstance(self.json, dict):
            try:
                object.__setattr__(self, "json", json.dumps(self.json))
            except RecursionError:
                raise too_deep from None
        if self.json is not None:
            if not isinstance(self.json, str):
                raise InvalidRequestError(f"structured_outputs.json must be a JSON Schema (an object), got "
                                          f"{type(self.json).__name__}", f"{PARAM}.json")
            if len(self.json) > MAX_GRAMMAR_CHARS:  # before parsing it
                raise InvalidRequestError(f"structured_outputs.json is {len(self.json)} characters; at most "
                                          f"{MAX_GRAMMAR_CHARS} are accepted", f"{PARAM}.json")
            try:
                schema = json.loads(self.json)
            except RecursionError:
                raise too_deep from None
            except ValueError as e:
                raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {e}", f"{PARAM}.json") from e
            if not isinstance(schema, dict):  # a boolean schema is valid JSON Schema, but llguidance takes objects
                raise InvalidRequestError("structured_outputs.json must be a JSON Schema object (for any JSON, use "
                                          f'{{}}; for any object, json_object), got {type(schema).__name__}',
                                          f"{PARAM}.json")
        if self.choice is not None:
            if isinstance(self.choice, (list, tuple)) and len(self.choice) > MAX_CHOICES:
                raise InvalidRequestError(f"structured_outputs.choice has {len(self.choice)} alternatives; at most "
                                          f"{MAX_CHOICES} are allowed", f"{PARAM}.choice")
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidRequestError("structured_outputs.choice must be a non-empty list of non-empty strings",
                                          f"{PARAM}.choice")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidRequestError(f"structured_outputs.{name} must be a non-empty string", f"{PARAM}.{name}")
        size = sum(len(x) for x in (self.json, self.regex, self.grammar) if x) + sum(map(len, self.choice or ()))
        if size > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(f"the structured output's definition is {size} characters; at most "
                                      f"{MAX_GRAMMAR_CHARS} are accepted", PARAM)

    def __getstate__(self) -> dict[str, Any]:
        # the compiled grammar kept by GrammarCompiler.compile (an llguidance matcher) does not
        # pickle, and is only valid with the tokenizer that compiled it
        return {k: v for k, v in self.__dict__.items() if k != "_compiled"}

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def grammar_text(self) -> str:
        """The llguidance grammar of this request. Raises InvalidRequestError for a definition that
        llguidance cannot read (a schema's or grammar's errors are found when it compiles)."""
        import llguidance

        kind = self.kind
        try:
            if kind in ("json", "json_object"):
                schema = self.json if kind == "json" else '{"type": "object"}'
                options: dict[str, Any] = {"whitespace_flexible": not self.disable_any_whitespace}
                if not self.disable_any_whitespace:
                    options["whitespace_pattern"] = self.whitespace_pattern or DEFAULT_WHITESPACE
                if self.disable_additional_properties:
                    schema = json.dumps(_no_additional_properties(json.loads(schema)))
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.regex)
            if kind == "choice":  # Lark string literals take JSON's escapes: any text is one literal
                return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, self.choice)))
            return llguidance.grammar_from("grammar", self.grammar)  # Lark, or GBNF converted to Lark
        except RecursionError:
            raise InvalidRequestError(f"the structured output's {kind} is nested too deeply to read: send a "
                                      "flatter definition", f"{PARAM}.{kind}") from None
        except ValueError as e:
            raise InvalidRequestError(f"the structured output's {kind} could not be read: {first_line(str(e))}",
                                      f"{PARAM}.{kind}") from e


def first_line(s: str) -> str:
    """The first line of llguidance's message, at most 500 characters (what follows can be pages of
    parser state)."""
    s = s.strip()
    return s.splitlines()[0][:500] if s else "unknown error"


def _no_additional_properties(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema without its own
    additionalProperties gets false."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema


def from_response_format(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
    """OpenAI's response_format ({"type": "text" | "json_object" | "json_schema", "json_schema":
    {"name", "schema", "strict"}}) as StructuredOutputsParams; None for plain text. The schema is
    enforced whether or not `strict` is set (strict only promises what this always does)."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            raise InvalidRequestError("response_format of type json_schema needs json_schema.schema (a JSON Schema "
                                      "object)", "response_format")
        return StructuredOutputsParams(json=schema)
    raise InvalidRequestError(f"response_format.type must be one of text, json_object, json_schema; got {kind!r}",
                              "response_format")
