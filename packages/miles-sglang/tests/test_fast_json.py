"""fast_json reads exactly what json.loads reads (values and errors), and writes JSON that reads
back as the value, on generated values and on the inputs orjson treats differently."""

from __future__ import annotations

import codecs
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.sglang_utils import fast_json

VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(VALUES)
def test_reads_and_writes_what_json_does(value):
    text = json.dumps(value)
    assert fast_json.loads(text.encode()) == json.loads(text)
    assert json.loads(fast_json.dumps(value)) == value


@pytest.mark.parametrize(
    "raw",
    [
        b'{"seed": 1180591620717411303424}',  # past 64 bits: orjson would give a float
        b"[-9223372036854775809, 18446744073709551616]",  # just past either end
        b"[NaN, Infinity, -Infinity]",
        b"[1e999]",
        b'"a\\ud800"',  # a lone surrogate, escaped
        b'"a\xed\xa0\x80"',  # and encoded
        codecs.BOM_UTF8 + b'{"a": 1}',
        '{"a": "\u00e9"}'.encode("utf-16"),
    ],
)
def test_what_orjson_reads_differently_reads_as_json_does(raw):
    expected, got = json.loads(raw), fast_json.loads(raw)
    assert repr(got) == repr(expected)  # repr: nan != nan, and 2**70 must stay an int


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1,]", b"\xff\xfe\x00", b"[" * 10_000])
def test_invalid_json_raises_what_json_raises(raw):
    # A ValueError, and a RecursionError for nesting past Python's limit.
    with pytest.raises((ValueError, RecursionError)) as expected:
        json.loads(raw)
    with pytest.raises(expected.type):
        fast_json.loads(raw)


def test_writes_what_orjson_cannot_through_json_and_non_finite_floats_as_null():
    assert json.loads(fast_json.dumps({"seed": 2**70, "ok": [1, "é"]})) == {
        "seed": 2**70,
        "ok": [1, "é"],
    }
    assert json.loads(fast_json.dumps({1: "a"})) == {"1": "a"}
    assert fast_json.dumps([math.inf, -math.inf, math.nan]) == b"[null,null,null]"
