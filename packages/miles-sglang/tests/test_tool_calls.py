"""Tool calls in model output (Qwen's `<tool_call>` format) -> OpenAI's message.tool_calls."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from miles.backends.sglang_utils.tool_calls import (
    TOOL_CALL_START,
    held_back,
    parse_tool_calls,
)

names = st.from_regex(r"[a-z_][a-z0-9_]{0,15}", fullmatch=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(max_size=8), json_values, max_size=4)


def render(name: str, args: dict, *, encode_arguments: bool = False) -> str:
    value = json.dumps(args) if encode_arguments else args
    return f"{TOOL_CALL_START}\n{json.dumps({'name': name, 'arguments': value})}\n</tool_call>"


@given(
    content=st.text(max_size=30).filter(lambda t: "<tool_call>" not in t),
    calls=st.lists(st.tuples(names, arguments, st.booleans()), min_size=1, max_size=3),
)
def test_calls_round_trip_with_their_arguments_and_the_text_before_them(content, calls):
    text = content + "\n".join(render(n, a, encode_arguments=e) for n, a, e in calls)
    parsed = parse_tool_calls(text, {n for n, _, _ in calls})
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (n, a) for n, a, _ in calls
    ]
    assert parsed.content == (content.rstrip() or None)
    assert len({c.id for c in parsed.tool_calls}) == len(calls)  # each call its own id


@given(text=st.text(max_size=60))
def test_text_without_a_complete_call_is_content_as_written(text):
    parsed = parse_tool_calls(text, {"add"})
    if "</tool_call>" not in text:
        assert parsed.tool_calls == [] and parsed.content == text


def test_a_malformed_or_unoffered_call_leaves_the_whole_output_as_text():
    good = render("add", {"a": 1})
    cases = [
        good + "<tool_call>{not json}</tool_call>",  # one bad call spoils them all
        render("rm_rf", {}),  # not among the tools offered
        "<tool_call>[1, 2]</tool_call>",  # not an object
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "add", "arguments": "[1]"}</tool_call>',  # arguments not an object
        good + " and then some prose",  # text after the calls
        "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>",  # nested past the recursion limit
        '<tool_call>{"name": "add", "arguments": {"a": "\\ud800"}}</tool_call>',  # half a pair
    ]
    for text in cases:
        parsed = parse_tool_calls(text, {"add"})
        assert parsed.tool_calls == [] and parsed.content == text, text


def test_a_streamed_tail_that_may_open_a_call_is_held_back():
    assert held_back("The answer <tool") == len("<tool")
    assert held_back("The answer <") == 1
    assert held_back("The answer") == 0
    assert held_back("a < b") == 0
    assert held_back("<tool_call") == len("<tool_call")
