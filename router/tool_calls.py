"""How a chat completion answers tool calls. A call it forced (docs/DESIGN.md §3.8): the
output, constrained to the call's JSON, becomes OpenAI's `tool_calls`: a named function's
arguments as they stream; under `tool_choice: "required"` the list of
{"name", "parameters"} calls, parsed once the output is complete. Calls the model chose
(`tool_choice: "auto"`): read from its text by its format (ParsedCalls, CALL_FORMATS)."""

from __future__ import annotations

import json
import re
import uuid

from outrider.router.text_stream import held_back


class CallIds:
    """The id of each call of a response's choices, made once: a streamed call sends it
    in its first chunk, and a message carries the same one."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], str] = {}  # (choice, call) -> its id

    def call(self, index: int, k: int, name: str, arguments: str,
             streamed: bool = True) -> dict:
        """Call k of choice `index`; a message's calls carry no `index` (OpenAI's do not,
        and clients send the message back as it came)."""
        call_id = self._ids.setdefault((index, k), f"call_{uuid.uuid4().hex[:24]}")
        call = {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}
        return {"index": k, **call} if streamed else call


class ForcedCalls:
    """The tool calls of one response's choices (`function`: the named function; "":
    any of the tools, 'required')."""

    def __init__(self, function: str) -> None:
        self.function = function
        self._ids = CallIds()
        self._texts: dict[int, str] = {}            # 'required', streamed: the output so far

    def message(self, index: int, text: str, finish_reason: str) -> tuple[dict, str]:
        """A choice's message and finish reason. An output cut before its JSON completed
        is shown as the text it is, with its `length`."""
        calls = self._parsed(text)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        return ({"role": "assistant", "content": None,
                 "tool_calls": [self._ids.call(index, k, name, arguments, streamed=False)
                                for k, (name, arguments) in enumerate(calls)]},
                self._finish(finish_reason))

    def first_delta(self, index: int) -> dict:
        if not self.function:
            return {"role": "assistant", "content": None}
        return {"role": "assistant", "content": None,
                "tool_calls": [self._ids.call(index, 0, self.function, "")]}

    def delta(self, index: int, text: str, finish_reason: str) -> tuple[dict | None, str]:
        """The next chunk's delta (None: nothing to show yet) and finish reason."""
        if self.function:
            arguments = [{"index": 0, "function": {"arguments": text}}]
            return ({"tool_calls": arguments} if text else {}), finish_reason
        self._texts[index] = self._texts.get(index, "") + text
        if not finish_reason:
            return None, finish_reason
        text = self._texts.pop(index)
        calls = self._parsed(text)
        if calls is None:
            return {"content": text}, finish_reason
        return ({"tool_calls": [self._ids.call(index, k, name, arguments)
                                for k, (name, arguments) in enumerate(calls)]},
                self._finish(finish_reason))

    def _parsed(self, text: str) -> list[tuple[str, str]] | None:
        """[(function, arguments as JSON text)]; None: not a whole list of calls."""
        if self.function:
            return [(self.function, text)]
        try:  # (the grammar shaped it; a list cut by max_tokens is no JSON)
            return [(c["name"], _compact(c["parameters"])) for c in json.loads(text)]
        except (ValueError, RecursionError, TypeError, KeyError):
            return None

    def _finish(self, finish_reason: str) -> str:
        # OpenAI: a call the model chose ('required') ends with "tool_calls", a named
        # function's with "stop"
        return "tool_calls" if finish_reason == "stop" and not self.function else finish_reason


def _compact(value) -> str:
    """JSON as the grammar writes it (no spaces); a number too large for a float, which
    would come out as Infinity, raises ValueError."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


# -- calls the model chose (tool_choice "auto"), read from its text by the served
# model's format (--tool-call-parser) -------------------------------------------------------
class CallFormat:
    """How a model family writes tool calls in its text: `marker` opens them (at the
    start of the output only, with `at_start`), `calls` reads [(name, arguments)] from
    the text that follows it (None: not calls after all)."""

    marker: str = ""
    at_start: bool = False

    def calls(self, text: str) -> list[tuple[str, dict]] | None:
        raise NotImplementedError


class Hermes(CallFormat):
    """Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, repeated."""

    marker = "<tool_call>"

    def calls(self, text: str) -> list[tuple[str, dict]] | None:
        blocks = re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", self.marker + text, re.S)
        return _named([_json(b) for b in blocks], "arguments")


class Mistral(CallFormat):
    """Mistral: [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]."""

    marker = "[TOOL_CALLS]"

    def calls(self, text: str) -> list[tuple[str, dict]] | None:
        found = _json(text)
        return _named(found if isinstance(found, list) else [found], "arguments")


class Llama3Json(CallFormat):
    """Llama 3.x JSON tools: the whole output is {"name": ..., "parameters": {...}} (calls
    separated by ';'), after an optional <|python_tag|>."""

    marker, at_start = "{", True

    def calls(self, text: str) -> list[tuple[str, dict]] | None:
        parts = ("{" + text).removeprefix("<|python_tag|>").split(";")
        return _named([_json(p) for p in parts], "parameters")


CALL_FORMATS: dict[str, type[CallFormat]] = {
    "hermes": Hermes, "mistral": Mistral, "llama3_json": Llama3Json}


class ParsedCalls:
    """The tool calls of one response's choices, read from text the model wrote freely
    (tool_choice "auto"): text before the first call is `content`, streamed as it comes
    (a tail that may begin the format's marker is held back); from the marker on, the
    text is held until the output ends, then answered as `tool_calls` (finish reason
    "tool_calls"), or as the text it was when it holds no call to an offered tool."""

    def __init__(self, form: CallFormat, tools: list[str]) -> None:
        self.form, self.tools = form, set(tools)
        self._ids = CallIds()
        self._held: dict[int, str] = {}    # a choice's output not yet shown
        self._shown: set[int] = set()      # choices that showed content already

    def message(self, index: int, text: str, finish_reason: str) -> tuple[dict, str]:
        content, calls = self._split(text, may_start=True)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return ({"role": "assistant", "content": content or None,
                 "tool_calls": [self._ids.call(index, k, name, arguments, streamed=False)
                                for k, (name, arguments) in enumerate(calls)]},
                _calls_finish(finish_reason))

    def first_delta(self, index: int) -> dict:
        return {"role": "assistant", "content": ""}

    def delta(self, index: int, text: str, finish_reason: str) -> tuple[dict | None, str]:
        held = self._held.pop(index, "") + text
        if finish_reason:
            content, calls = self._split(held, may_start=index not in self._shown)
            if not calls:
                return ({"content": held} if held else {}), finish_reason
            delta = {"tool_calls": [self._ids.call(index, k, name, arguments)
                                    for k, (name, arguments) in enumerate(calls)]}
            return ({"content": content, **delta} if content else delta,
                    _calls_finish(finish_reason))
        at = self._marker_at(held, may_start=index not in self._shown)
        cut = at if at >= 0 else len(held) - held_back(held, (self.form.marker,))
        show, self._held[index] = held[:cut], held[cut:]
        if show:
            self._shown.add(index)
        return ({"content": show} if show else None), finish_reason

    def _marker_at(self, text: str, may_start: bool) -> int:
        """Where the calls begin in `text` (-1: not in it); a format whose calls are the
        whole output (`at_start`) has them only if nothing was shown before."""
        if not self.form.at_start:
            return text.find(self.form.marker)
        return text.find(self.form.marker) if may_start and text.lstrip().startswith(
            self.form.marker) else -1

    def _split(self, text: str, may_start: bool) -> tuple[str, list[tuple[str, str]]]:
        """(content before the calls, [(name, arguments as JSON text)]); no calls when the
        text holds none, or one to a function the request did not offer."""
        at = self._marker_at(text, may_start)
        if at < 0:
            return text, []
        found = self.form.calls(text[at + len(self.form.marker):])
        if not found or any(name not in self.tools for name, _ in found):
            return text, []
        try:
            return text[:at], [(name, _compact(arguments)) for name, arguments in found]
        except ValueError:
            return text, []


def _calls_finish(finish_reason: str) -> str:
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _json(text: str):
    try:
        return json.loads(text.strip())
    except (ValueError, RecursionError):
        return None


def _named(found: list, arguments_key: str) -> list[tuple[str, dict]] | None:
    """[(name, arguments)] of call objects; None when any is not one."""
    calls = []
    for call in found:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return None
        arguments = call.get(arguments_key, call.get("arguments", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append((call["name"], arguments))
    return calls

