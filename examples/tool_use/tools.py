"""The tool of the tool-use example: an exact calculator, and the two ways a tool fails.

`calc` computes a*b or a/b for whole numbers, exactly: a quotient is written out as a
decimal, digit by digit, until the division comes out even. That is right for 47/8 (5.875) and a
hang for 47/86, whose decimal never ends, the kind of bug a real tool has: only the rollout's
--tool-timeout-s gets the episode past it. A division by zero raises ZeroDivisionError and an
expression it cannot read raises ValueError. The model reads a failure as the tool's result
(`error: ...`) and the rollout counts it (rollout/tool_failures/*); the training prompts hold a
few divisions of each kind (task.py), so every run exercises both.
"""

from __future__ import annotations

import asyncio
import re

_EXPRESSION = re.compile(r"\s*(\d+)\s*([*/])\s*(\d+)\s*")


async def calc(expr: str) -> str:
    """Compute a*b or a/b exactly."""
    match = _EXPRESSION.fullmatch(expr)
    if match is None:
        raise ValueError(f"cannot read {expr!r}: write a*b or a/b with whole numbers")
    a, operator, b = int(match[1]), match[2], int(match[3])
    if operator == "*":
        return str(a * b)
    return await exact_quotient(a, b)


async def exact_quotient(a: int, b: int) -> str:
    """a/b as a decimal with every digit; never returns when the decimal repeats (b has a prime
    factor other than 2 and 5)."""
    whole, rest = divmod(a, b)  # ZeroDivisionError when b is 0
    digits = []
    while rest:
        # An async tool must yield while it works: the event loop it shares with the rollout
        # can then cancel it at --tool-timeout-s (a sync tool would keep its thread forever).
        await asyncio.sleep(0)
        digit, rest = divmod(rest * 10, b)
        digits.append(str(digit))
    return f"{whole}.{''.join(digits)}" if digits else str(whole)
