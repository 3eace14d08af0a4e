"""Paths of a run, resolved against the launch directory: Ray workers run elsewhere.

`MilesConfig` resolves them last, after every other check, so that those errors name each path as
the user wrote it.
"""

from __future__ import annotations

import os
import re

# What Hugging Face accepts as a repository id: "name" or "org/name", no leading dot.
_HUB_ID = re.compile(r"[\w-][\w.-]*(/[\w-][\w.-]*)?")


def absolute(path: str | None) -> str | None:
    """`path` made absolute (`~` expanded); None stays None."""
    return None if path is None else _absolute(path)


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def check_hf_checkpoint(hf_checkpoint: str) -> None:
    """Refuse an --hf-checkpoint that is neither an existing path nor a hub id."""
    if os.path.exists(os.path.expanduser(hf_checkpoint)) or _HUB_ID.fullmatch(hf_checkpoint):
        return
    # A hub id ("Qwen/Qwen3-0.6B") is resolved by transformers; anything else is a path,
    # and a missing one would otherwise fail as a malformed hub id after the start-up.
    raise ValueError(
        f"--hf-checkpoint {hf_checkpoint}: no such directory; pass an existing "
        "Hugging Face checkpoint directory or a hub id (org/name)"
    )


def hf_checkpoint_path(hf_checkpoint: str) -> str:
    """An existing --hf-checkpoint made absolute; a hub id as it is."""
    if os.path.exists(os.path.expanduser(hf_checkpoint)):
        return _absolute(hf_checkpoint)
    return hf_checkpoint


def eval_prompt_paths(pairs: list[str] | None) -> list[str] | None:
    """--eval-prompt-data name/path pairs with each path made absolute."""
    if not pairs:
        return pairs
    return [item if i % 2 == 0 else _absolute(item) for i, item in enumerate(pairs)]
