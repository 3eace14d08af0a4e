"""Options read off config dataclasses: one flag per field, typed, documented by the field docstring.

Every group of the schema is a plain `@dataclass(kw_only=True)` owned by the component it configures
(the data source, the reward hub, the loss); this module turns its fields into `Option`s and converts
YAML or command-line values to the field's type. A field name shared by two groups is one option
whose value goes to both (e.g. `rollout_seed` seeds the data source's order and the rollout's sampling).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

MISSING = dataclasses.MISSING


@dataclass(frozen=True)
class Option:
    """One setting: its name (`rollout_batch_size`), type, default and the groups it configures."""

    name: str
    annotation: Any
    default: Any
    doc: str
    groups: tuple[str, ...]

    @property
    def flag(self) -> str:
        return flag_name(self.name)

    @property
    def required(self) -> bool:
        return self.default is MISSING

    @property
    def choices(self) -> tuple[Any, ...]:
        return literal_choices(strip_optional(self.annotation))

    @property
    def is_bool(self) -> bool:
        return strip_optional(self.annotation) is bool

    @property
    def is_list(self) -> bool:
        return get_origin(strip_optional(self.annotation)) is list

    @property
    def type_name(self) -> str:
        return type_name(self.annotation)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def strip_optional(annotation: Any) -> Any:
    """`X` for `X | None`; other annotations unchanged."""
    if _is_optional(annotation):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        return rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]  # noqa: UP007
    return annotation


def literal_choices(annotation: Any) -> tuple[Any, ...]:
    return get_args(annotation) if get_origin(annotation) is Literal else ()


def type_name(annotation: Any) -> str:
    """Short, user-facing name of a field type: `int`, `str | None`, `list[str]`, `grpo | ppo`."""
    optional = _is_optional(annotation)
    inner = strip_optional(annotation)
    if literal_choices(inner):
        text = " | ".join(str(c) for c in literal_choices(inner))
    elif get_origin(inner) is list:
        (item,) = get_args(inner)
        text = f"list[{item.__name__}]"
    else:
        text = getattr(inner, "__name__", str(inner))
    return f"{text} | None" if optional else text


def _is_optional(annotation: Any) -> bool:
    return isinstance(annotation, types.UnionType | typing._UnionGenericAlias) and type(  # type: ignore[attr-defined]
        None
    ) in get_args(annotation)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (and of its bases), by field name.

    Read from the source, like Sphinx's attribute docstrings, so a field is documented once,
    next to its definition, and `--help` and the generated reference cannot drift from it.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
        for node, following in zip(body, [*body[1:], None], strict=True):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            if (
                isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = " ".join(inspect.cleandoc(following.value.value).split())
    return docs


def dataclass_options(cls: type, group: str) -> list[Option]:
    """One `Option` per init field of the dataclass `cls`, in definition order."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    options = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = MISSING
        options.append(Option(f.name, hints[f.name], default, docs.get(f.name, ""), (group,)))
    return options


# -- converting values --------------------------------------------------------------------------


def convert(value: Any, annotation: Any, where: str) -> Any:
    """`value` (from YAML or a command-line string) as a value of `annotation`, or a ValueError
    naming `where` (the flag or the YAML key) and what was expected."""
    if _is_optional(annotation):
        # A list flag takes `none` as its only item too: `--eval-prompt-data none` clears a
        # list that the --config file set.
        only = value[0] if isinstance(value, list | tuple) and len(value) == 1 else value
        if only is None or (isinstance(only, str) and only.lower() in ("none", "null")):
            return None
        annotation = strip_optional(annotation)
    choices = literal_choices(annotation)
    if choices:
        text = value if isinstance(value, str) else str(value)
        if text not in [str(c) for c in choices]:
            raise ValueError(
                f"{where}: {value!r} is not a valid choice; choose from "
                f"{', '.join(str(c) for c in choices)}"
            )
        return text
    if get_origin(annotation) is list:
        (item,) = get_args(annotation)
        items = value if isinstance(value, list | tuple) else [value]
        return [convert(v, item, where) for v in items]
    if get_origin(annotation) is dict:
        return _to_json_object(value, where)
    converter = _CONVERTERS.get(annotation)
    if converter is None:
        return value  # structured YAML values (dicts) pass through; their owner validates them
    to_type, expected = converter
    try:
        return to_type(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected {expected}, got {value!r}") from None


def _to_json_object(value: Any, where: str) -> dict:
    """A YAML mapping as is; a command-line string parsed as a JSON object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise ValueError(f"{where}: expected a JSON object, got {value!r} ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, got {value!r}")
    return value


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(value)


def _to_int(value: Any) -> int:
    # bool is an int subclass, and int(2.5) would truncate silently: accept neither.
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(value)
    return int(value)


def _to_float(value: Any) -> float:
    # PyYAML reads `1e-6` (no dot) as a string, so strings are parsed too.
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(value)
    return float(value)


def _to_str(value: Any) -> str:
    if isinstance(value, dict | list):
        raise TypeError(value)
    return str(value)


_CONVERTERS: dict[Any, tuple[Any, str]] = {
    bool: (_to_bool, "true or false"),
    int: (_to_int, "an integer"),
    float: (_to_float, "a number"),
    str: (_to_str, "a string"),
}
