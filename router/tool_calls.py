"""How a chat completion answers the tool call it forced (docs/DESIGN.md §3.8). The
output, constrained to the call's JSON, becomes OpenAI's `tool_calls`: a named function's
arguments as they stream; under `tool_choice: "required"` the list of
{"name", "parameters"} calls, parsed once the output is complete."""

from __future__ import annotations

import json
import uuid


class ForcedCalls:
    """The tool calls of one response's choices (`function`: the named function; "":
    any of the tools, 'required')."""

    def __init__(self, function: str) -> None:
        self.function = function
        self._ids: dict[tuple[int, int], str] = {}  # (choice, call) -> its id
        self._texts: dict[int, str] = {}            # 'required', streamed: the output so far

    def message(self, index: int, text: str, finish_reason: str) -> tuple[dict, str]:
        """A choice's message and finish reason. An output cut before its JSON completed
        is shown as the text it is, with its `length`."""
        calls = self._parsed(text)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        return ({"role": "assistant", "content": None,
                 "tool_calls": [self._call(index, k, name, arguments, streamed=False)
                                for k, (name, arguments) in enumerate(calls)]},
                self._finish(finish_reason))

    def first_delta(self, index: int) -> dict:
        if not self.function:
            return {"role": "assistant", "content": None}
        return {"role": "assistant", "content": None,
                "tool_calls": [self._call(index, 0, self.function, "")]}

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
        return ({"tool_calls": [self._call(index, k, name, arguments)
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

    def _call(self, index: int, k: int, name: str, arguments: str,
              streamed: bool = True) -> dict:
        """Call k of choice `index`; a message's calls carry no `index` (OpenAI's do not,
        and clients send the message back as it came)."""
        call_id = self._ids.setdefault((index, k), f"call_{uuid.uuid4().hex[:24]}")
        call = {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}
        return {"index": k, **call} if streamed else call


def _compact(value) -> str:
    """JSON as the grammar writes it (no spaces); a number too large for a float, which
    would come out as Infinity, raises ValueError."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
