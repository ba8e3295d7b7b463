"""Tool calls read from a model's text by its format (tool_choice "auto",
--tool-call-parser): whole answers and streams cut anywhere, and text that only looks
like calls answered as text."""

from __future__ import annotations

import json

import pytest
from outrider.router.tool_calls import CALL_FORMATS, ParsedCalls

WRITTEN = {
    "hermes": ('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
               '\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
               "Let me look.\n"),
    "mistral": ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, '
                '{"name": "g", "arguments": {}}]', None),
    "llama3_json": ('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
                    None),
}


def calls_of(parsed: ParsedCalls, text: str) -> tuple[str | None, list, str]:
    message, finish = parsed.message(0, text, "stop")
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in message.get("tool_calls", [])]
    return message["content"], calls, finish


@pytest.mark.parametrize("form", sorted(WRITTEN))
def test_calls_are_read_whole_and_streamed_in_pieces_of_any_size(form):
    text, content = WRITTEN[form]
    assert calls_of(ParsedCalls(CALL_FORMATS[form](), ["f", "g"]), text) == (
        content, [("f", {"a": 1}), ("g", {})], "tool_calls")
    for size in (1, 3, 7, len(text)):
        parsed = ParsedCalls(CALL_FORMATS[form](), ["f", "g"])
        deltas = [parsed.delta(0, text[i:i + size], "")[0] for i in range(0, len(text), size)]
        last, finish = parsed.delta(0, "", "stop")
        shown = "".join(d.get("content", "") for d in [*deltas, last] if d)
        assert shown == (content or "") and finish == "tool_calls", size
        assert [c["function"]["name"] for c in last["tool_calls"]] == ["f", "g"]


@pytest.mark.parametrize("text", [
    'plain text, no calls',
    'see <tool_call>{"name": "h", "arguments": {}}</tool_call>',  # h was not offered
    'see <tool_call>{"name": "f", "arguments": {"a": </tool_call>',  # cut JSON
    'a < b and <tool',  # a marker's start that never completes
])
def test_text_that_holds_no_call_to_an_offered_tool_is_answered_as_text(text):
    parsed = ParsedCalls(CALL_FORMATS["hermes"](), ["f"])
    assert calls_of(parsed, text) == (text, [], "stop")
    streamed = ParsedCalls(CALL_FORMATS["hermes"](), ["f"])
    deltas = [streamed.delta(0, ch, "")[0] for ch in text] + [streamed.delta(0, "", "stop")[0]]
    assert "".join(d.get("content", "") for d in deltas if d) == text


def test_llama3_calls_are_the_whole_output_only():
    parsed = ParsedCalls(CALL_FORMATS["llama3_json"](), ["f"])
    text = 'I will call {"name": "f", "parameters": {}}'
    assert calls_of(parsed, text) == (text, [], "stop")
