"""A Hugging Face checkpoint directory named by a flag, checked before anything starts."""

from __future__ import annotations

import os


def hf_checkpoint_dir(flag: str, path: str) -> str:
    """`path` as an absolute directory (Ray workers run elsewhere); refused, naming `flag`, when
    it is missing or holds no config.json."""
    absolute = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(os.path.join(absolute, "config.json")):
        why = "holds no config.json" if os.path.isdir(absolute) else "does not exist"
        raise ValueError(
            f"{flag} {path}: {absolute} {why}; pass a Hugging Face checkpoint directory (e.g. "
            "one written by `miles export-hf`)"
        )
    return absolute
