"""`--rm-type math`: 1.0 when the response's final answer equals `sample.label` mathematically.

Answers are extracted and compared by math-verify (`\\boxed{}`, `$...$`, plain numbers and LaTeX;
`1/2`, `0.5` and `\\frac{2}{4}` are equal). math-verify's own timeouts use `signal.alarm`, which
only works in the main thread, while the hub runs rewards in worker threads: they are switched off
here and the hub's `--rm-timeout-s` bounds each evaluation instead.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

from miles.backends.training_utils.batching.sample import Sample


def _not_timeout_disabled_warning(record: logging.LogRecord) -> bool:
    # math-verify warns once that its timeouts are off and the caller must bound the time itself;
    # the hub does (--rm-timeout-s), so the warning would only send users looking for a problem.
    return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_not_timeout_disabled_warning)


@functools.cache
def _math_verify() -> ModuleType:
    # Imported on first use: math-verify brings sympy (seconds of import), which a run scoring
    # with another --rm-type never needs, and the configuration lists this reward by name.
    import math_verify

    return math_verify


def parse_label(label: str) -> list:
    """math-verify's parse of a bare ground-truth answer, e.g. `2,3`, `\\sqrt{2}` or `x^2+1`.

    A label is the answer alone, without the `$...$` or `\\boxed{}` that mark an answer inside a
    response, and math-verify finds no LaTeX without them (or reads `2,3` as 2.3): so it is
    parsed as if boxed, unless it already carries its own delimiters.
    """
    parse = _math_verify().parse
    if "$" not in label and "\\boxed" not in label:
        parsed = parse(f"\\boxed{{{label}}}", parsing_timeout=None)
        if parsed:
            return parsed
    return parse(label, parsing_timeout=None)


def math_reward(sample: Sample) -> float:
    """1.0 if the response's answer verifies against the label, 0.0 if not or if it has none.

    Raises ValueError when the label is missing or has no parseable answer: that is a data
    problem, which the hub counts as a failure rather than silently scoring every answer 0.
    """
    if sample.label is None:
        raise ValueError(
            f"sample {sample.index}: --rm-type math compares against sample.label, which is None; "
            "give the data source a label column"
        )
    gold = parse_label(sample.label)
    if not gold:
        raise ValueError(
            f"sample {sample.index}: math-verify found no answer in the label {sample.label!r}; "
            "write labels as a number or LaTeX expression"
        )
    answer = _math_verify().parse(sample.response, parsing_timeout=None)
    if not answer:
        return 0.0
    return 1.0 if _math_verify().verify(gold, answer, timeout_seconds=None) else 0.0
