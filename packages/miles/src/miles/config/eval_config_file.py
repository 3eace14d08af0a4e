"""Reading an `--eval-config` file (YAML or JSON), in upstream miles' layout:

    eval:                    # optional wrapper
      defaults:              # settings every dataset gets unless it sets its own
        max_response_len: 64
      datasets:              # a list of mappings with a `name`, or a mapping name -> settings
        - name: aime
          path: data/aime.jsonl
          n_samples_per_eval_prompt: 16

This module checks the layout, the keys and that names are unique, and returns each dataset's raw
settings (defaults merged in); what the values mean is `miles.config.eval_datasets`'s business.
Every message names the file, and the dataset where there is one.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

_SUFFIXES = (".yaml", ".yml", ".json")
_IDENTITY_KEYS = ("name", "path")


def read_eval_config(path: str, known_keys: Collection[str]) -> list[dict[str, Any]]:
    """Each dataset's settings, in file order: `name`, `path` and any of `known_keys`."""
    where = f"--eval-config {path}"
    document = _load(Path(path), where)
    root = document.get("eval", document) if isinstance(document, dict) else document
    if not isinstance(root, dict):
        raise ValueError(
            f"{where} must hold a mapping with `datasets` (optionally under `eval:`), got a "
            f"{type(root).__name__}"
        )
    _check_keys(root, ("defaults", "datasets"), f"{where}: the top level", hint="")
    defaults = root.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ValueError(f"{where}: `defaults` must be a mapping of settings, got {defaults!r}")
    _check_keys(defaults, known_keys, f"{where}: `defaults`", hint=_known(known_keys))
    entries = _entries(root.get("datasets"), where)
    datasets, seen = [], set()
    for position, entry in enumerate(entries, start=1):
        name = entry.get("name")
        if not isinstance(name, str) or not name.strip() or "/" in name:
            raise ValueError(
                f"{where}: dataset #{position} needs a `name` (a non-empty string without '/', "
                f"used in its metrics eval/<name>/...), got {name!r}"
            )
        if name in seen:
            raise ValueError(
                f"{where}: dataset {name!r} is listed twice; give each dataset its own name"
            )
        seen.add(name)
        _check_keys(
            entry, (*_IDENTITY_KEYS, *known_keys), f"{where}: dataset {name!r}", _known(known_keys)
        )
        if entry.get("path") is None:
            raise ValueError(f"{where}: dataset {name!r} has no `path`; name its prompt file")
        datasets.append({**defaults, **entry})
    return datasets


def _load(path: Path, where: str) -> Any:
    if path.suffix.lower() not in _SUFFIXES:
        raise ValueError(f"{where} must be a {', '.join(_SUFFIXES)} file, got {path.suffix!r}")
    if not path.is_file():
        raise ValueError(f"{where}: no such file")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"{where} is not valid {path.suffix[1:].upper()}: {err}") from None


def _entries(datasets: Any, where: str) -> list[dict[str, Any]]:
    """The datasets as a list of mappings; a mapping name -> settings names each by its key."""
    if isinstance(datasets, dict):
        datasets = [{"name": name, **_mapping(s, where, name)} for name, s in datasets.items()]
    if not isinstance(datasets, list) or not datasets:
        raise ValueError(
            f"{where} lists no datasets: add `datasets:` with one entry per dataset "
            "(name: ..., path: ...)"
        )
    return [_mapping(entry, where, f"#{i}") for i, entry in enumerate(datasets, start=1)]


def _mapping(value: Any, where: str, which: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(
            f"{where}: dataset {which} must be a mapping of settings (name: ..., path: ...), "
            f"got {value!r}"
        )
    return {str(k): v for k, v in value.items()}


def _check_keys(mapping: dict[str, Any], known: Collection[str], where: str, hint: str) -> None:
    for key in mapping:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
        fix = f"did you mean {close[0]!r}?" if close else f"remove it{hint}"
        raise ValueError(f"{where} has an unknown key {key!r}; {fix}")


def _known(keys: Collection[str]) -> str:
    return f" (known keys: {', '.join(keys)})"
