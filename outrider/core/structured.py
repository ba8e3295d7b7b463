"""Structured outputs: what a request's output must match — a JSON schema, any JSON
object, a regex, one of several strings or a Lark grammar (docs/DESIGN.md §3.8).

`StructuredOutput` is the request's side: validated, on the wire, and turned into a
grammar. It imports no grammar engine until a grammar is asked for, so the SDK installs
without one; `outrider/core/grammar.py` compiles and enforces it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property

from outrider.v1 import generate_pb2 as gp

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar's text
MAX_CHOICES = 256


class StructuredOutputError(ValueError):
    """A constraint that cannot be used; the message names the field and the problem."""


@dataclass(frozen=True)
class StructuredOutput:
    """One request's constraint. `value`: the schema as JSON text, the regex or the
    grammar; for `choice`, the strings; unused for `json_object`."""

    kind: str
    value: str | tuple[str, ...] = ""
    whitespace_flexible: bool = False  # JSON: any whitespace between tokens (else compact)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"structured_output: kind must be one of "
                                        f"{', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            if not self.value or len(self.value) > MAX_CHOICES:
                raise StructuredOutputError(
                    f"structured_output.choice: between 1 and {MAX_CHOICES} strings, "
                    f"got {len(self.value)}")
            if any(not c for c in self.value):
                raise StructuredOutputError("structured_output.choice: a choice is empty")
        elif self.kind != "json_object" and not self.value:
            raise StructuredOutputError(f"structured_output.{self.kind} is empty")
        if sum(map(len, self.value if self.kind == "choice" else [self.value])) > MAX_SPEC_CHARS:
            raise StructuredOutputError(f"structured_output.{self.kind}: at most "
                                        f"{MAX_SPEC_CHARS} characters")

    @property
    def field(self) -> str:
        return f"structured_output.{self.kind}"

    @cached_property
    def grammar(self) -> str:
        """llguidance's grammar for it (its validity is checked by `Grammars.check`)."""
        from llguidance import LLMatcher  # only where grammars are compiled (not the SDK)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        options = {"whitespace_flexible": self.whitespace_flexible}
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except ValueError as e:
                raise StructuredOutputError(f"{self.field}: not JSON ({e})") from None
            if not isinstance(schema, dict | bool):
                raise StructuredOutputError(f"{self.field}: a schema is an object or a boolean")
            return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":  # JSON string literals are Lark string literals
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.value))
        lark = gbnf_to_lark(self.value) if "::=" in self.value else self.value
        return LLMatcher.grammar_from_lark(lark)

    @cached_property
    def key(self) -> str:
        return hashlib.sha256(self.grammar.encode()).hexdigest()

    def to_proto(self) -> gp.StructuredOutput:
        if self.kind == "choice":
            return gp.StructuredOutput(choice=gp.Choices(choices=self.value),
                                       whitespace_flexible=self.whitespace_flexible)
        value = True if self.kind == "json_object" else self.value
        return gp.StructuredOutput(whitespace_flexible=self.whitespace_flexible,
                                   **{self.kind: value})

    @classmethod
    def from_proto(cls, msg: gp.StructuredOutput) -> StructuredOutput | None:
        """None when no kind is set (or json_object is false)."""
        kind = msg.WhichOneof("kind")
        if kind is None or (kind == "json_object" and not msg.json_object):
            return None
        value = (tuple(msg.choice.choices) if kind == "choice"
                 else "" if kind == "json_object" else getattr(msg, kind))
        return cls(kind, value, msg.whitespace_flexible)
