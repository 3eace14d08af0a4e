"""Reading a run's configuration: `--config FILE.yaml`, then command-line flags on top.

The YAML file is either flat (`rollout_batch_size: 8`) or grouped by section (`rollout:` then
`rollout_batch_size: 8`); keys may use `_` or `-`. Unknown keys and flags are errors that name the
closest valid setting. The backend is chosen first (flag, then file, then default), because its
wheel decides which backend flags exist.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from miles.backends.sglang_utils.sglang_flags import sglang_args_from_cli
from miles.config.groups import ClusterConfig
from miles.config.miles_config import MilesConfig
from miles.config.options import Option, convert
from miles.config.registry import BACKEND_GROUP, CORE_GROUPS, Schema

DEFAULT_BACKEND = ClusterConfig.train_backend


def load_config(argv: Sequence[str] = ()) -> MilesConfig:
    """The validated configuration of `miles train ARGV...` (no `--help` handling)."""
    # Every SGLang server flag passes through as --sglang-<flag> (architecture.md: "Contracts / Rollout engine", the SGLang engine).
    sglang_flags, argv = sglang_args_from_cli(list(argv), miles_flags={"--sglang-server-args"})
    config_path = _peek_flag(argv, "--config")
    file_values = read_yaml(config_path) if config_path else {}
    backend = _peek_flag(argv, "--train-backend") or str(
        file_values.get("train_backend", DEFAULT_BACKEND)
    )
    schema = Schema.for_backend(backend)
    values = _check_yaml(schema, file_values, config_path)
    values.update(parse_flags(schema, argv))
    if sglang_flags:
        passed = [_as_item(name, value) for name, value in sglang_flags.items()]
        values["sglang_server_args"] = [*(values.get("sglang_server_args") or []), *passed]
    return MilesConfig.from_values(schema, values)


def _as_item(name: str, value: Any) -> str:
    """`--sglang-<name> value` as a --sglang-server-args item: name=value, or name for a switch."""
    if value is True:
        return name
    return f"{name}={' '.join(value) if isinstance(value, list) else value}"


def build_parser(schema: Schema, prog: str = "miles train") -> argparse.ArgumentParser:
    """An argparse parser with one section per group; used for `--help` and for parsing."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train a language model with reinforcement learning. Settings come from "
        "defaults, then --config FILE.yaml, then these flags (the last one wins).",
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", metavar="FILE.yaml", help="YAML file of settings (flat, or by section)"
    )
    sections = {
        group: parser.add_argument_group(
            f"{group} settings", " ".join((cls.__doc__ or "").split()) or None
        )
        for group, cls in schema.groups.items()
    }
    for option in schema.options.values():
        _add_option(sections[option.groups[0]], option)
    return parser


# Short spellings users know from other tools; the field name cannot be a Python keyword.
FLAG_ALIASES: dict[str, tuple[str, ...]] = {"async_train": ("--async",)}


def _add_option(section: argparse._ArgumentGroup, option: Option) -> None:
    help_text = option.doc.replace("%", "%%")
    if option.required:
        help_text += " (required)"
    else:
        help_text += f" (default: {option.default})".replace("%", "%%")
    flags = (option.flag, *FLAG_ALIASES.get(option.name, ()))
    if option.is_bool:
        section.add_argument(
            *flags, action=argparse.BooleanOptionalAction, help=help_text, dest=option.name
        )
        return
    metavar = "{" + ",".join(map(str, option.choices)) + "}" if option.choices else None
    section.add_argument(
        option.flag,
        dest=option.name,
        nargs="+" if option.is_list else None,
        metavar=metavar or option.name.upper(),
        help=help_text,
    )


def parse_flags(schema: Schema, argv: Sequence[str]) -> dict[str, Any]:
    """Settings given on the command line (name -> converted value); absent flags are absent."""
    parser = build_parser(schema)
    # parse_known_args, not parse_args: an unknown flag gets our error with a suggestion
    # instead of argparse's exit.
    namespace, unknown = _parse_known(parser, argv)
    if unknown:
        first = next((a for a in unknown if a.startswith("-")), unknown[0])
        if not first.startswith("-"):
            raise ValueError(
                f"unexpected argument {first!r}; settings are flags like --rollout-batch-size 8"
            )
        raise schema.unknown(first.split("=", 1)[0], "the command line")
    values = vars(namespace)
    values.pop("config", None)
    return {
        name: convert(value, schema.options[name].annotation, schema.options[name].flag)
        for name, value in values.items()
    }


def _parse_known(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[argparse.Namespace, list[str]]:
    try:
        return parser.parse_known_args(list(argv))
    except SystemExit as exit_:
        # argparse exits on a malformed flag (e.g. a missing value); `--help` also exits, and
        # that is wanted, so only turn usage errors (status 2) into exceptions.
        if exit_.code == 2:
            raise ValueError(f"could not parse the command line {' '.join(argv)!r}") from None
        raise


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Raw settings of a YAML file, flattened: sections (`rollout: {...}`) are merged."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config {path}: no such file")
    with path.open() as f:
        raw = yaml.safe_load(f)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(
            f"--config {path} must hold a mapping of settings (rollout_batch_size: 8, ...), "
            f"got a {type(raw).__name__}"
        )
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        is_section = isinstance(value, dict) and str(key) in (*CORE_GROUPS, BACKEND_GROUP)
        for name, item in value.items() if is_section else [(key, value)]:
            name = str(name).replace("-", "_")
            if name in flat:
                raise ValueError(f"--config {path} sets {name!r} twice")
            flat[name] = item
    return flat


def _check_yaml(schema: Schema, raw: dict[str, Any], path: str | None) -> dict[str, Any]:
    values = {}
    for name, value in raw.items():
        option = schema.options.get(name)
        if option is None:
            raise schema.unknown(name, f"--config {path}")
        values[name] = convert(value, option.annotation, f"{name!r} in --config {path}")
    return values


def _peek_flag(argv: list[str], flag: str) -> str | None:
    """The value of `flag` in argv (last one wins), before the full parse."""
    found = None
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif token.startswith(flag + "="):
            found = token.split("=", 1)[1]
    return found
