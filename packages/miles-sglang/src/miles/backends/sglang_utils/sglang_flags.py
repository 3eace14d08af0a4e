"""`--sglang-<flag>` on miles's command line: every SGLang server flag, passed through verbatim.

Parsing them is the configuration's job, so this module is plain Python: it imports neither SGLang
nor torch (the engine launcher, `sglang_engine`, turns the flags back into a command line).
"""

from __future__ import annotations

from collections.abc import Collection

SGLANG_FLAG_PREFIX = "--sglang-"
SGLangFlagValue = str | bool | list[str]
"""A flag's value: True for a bare switch (False omits it), a list for multi-value flags."""


def sglang_args_from_cli(
    argv: list[str], *, miles_flags: Collection[str] = ()
) -> tuple[dict[str, SGLangFlagValue], list[str]]:
    """Split `--sglang-<flag> [values]` out of argv: ({flag: value}, the remaining argv).

    A flag takes the tokens up to the next `--...` token: none is a switch (True), one a string,
    several a list; `--sglang-flag=value` takes exactly one. `miles_flags` names `--sglang-*`
    flags that belong to miles itself (e.g. `--sglang-router-port`): they stay in the remaining
    argv. Everything after a bare `--` is left alone.
    """
    flags: dict[str, SGLangFlagValue] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            rest.extend(argv[i:])
            break
        i += 1
        if not token.startswith(SGLANG_FLAG_PREFIX) or token.split("=")[0] in miles_flags:
            rest.append(token)
            continue
        name, has_inline, inline = token[len(SGLANG_FLAG_PREFIX) :].partition("=")
        name = name.replace("_", "-")  # SGLang's argparse spells every flag with dashes
        if not name or name.startswith("-"):
            raise ValueError(f"{token!r} names no SGLang flag; write {SGLANG_FLAG_PREFIX}<flag>")
        if name in flags:
            raise ValueError(f"{SGLANG_FLAG_PREFIX}{name} is given twice; keep one")
        if has_inline:
            flags[name] = inline
            continue
        values: list[str] = []
        while i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        flags[name] = True if not values else values[0] if len(values) == 1 else values
    return flags, rest
