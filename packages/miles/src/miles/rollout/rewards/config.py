"""`RewardConfig`: which reward scores the rollout (`--rm-type`) and how it is called, validated.

Every flag that the chosen reward type would ignore is an error rather than a silent no-op
(architecture.md: "Design rules"); the custom function's import happens later, in `RewardHub`, so
a config can be validated on a machine that lacks the user's module.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields
from typing import Literal, get_args

from miles.backends.training_utils.infra.import_path import ImportPathError, split_import_path

RmType = Literal["math", "exact_match", "f1", "remote", "custom"]
RM_TYPES: tuple[str, ...] = get_args(RmType)
BUILTIN_RM_TYPES: tuple[str, ...] = ("math", "exact_match", "f1")
"""Rule-based rewards that ship with miles; each scores one sample against `sample.label`."""
CUSTOM_RM_PATH_FLAG = "--custom-rm-path"


@dataclass(kw_only=True)
class RewardConfig:
    """How the reward hub scores samples; flags are the `--` spellings of the field names."""

    rm_type: RmType = "math"
    """`math` (math-verify equivalence), `exact_match`, `f1` (SQuAD token F1), `remote` (an HTTP
    reward model at `rm_url`) or `custom` (the function at `custom_rm_path`)."""
    custom_rm_path: str | None = None
    """`package.module:function` (or `package.module.function`) of the custom reward; custom only."""
    rm_url: str | None = None
    """URL the remote reward model answers POSTs at; remote only."""
    rm_timeout_s: float = 30.0
    """Deadline for one evaluation: one sample, or one group with `group_rm`; retries included."""
    rm_max_retries: int = 2
    """Remote only: retries after a connection error or 5xx (never a 4xx), with backoff."""
    rm_concurrency: int = 64
    """Most evaluations in flight at once (threads for sync functions, requests for remote)."""
    group_rm: bool = False
    """Call the reward once per group (a list of samples -> a list of rewards); remote/custom only."""
    reward_failure_score: float = 0.0
    """Reward of a sample whose reward function raised, timed out or returned a non-number."""
    reward_key: str | None = None
    """Remote/custom only: when the reward returns a dict, the key holding the reward (default
    `reward`)."""
    reward_clip: float | None = None
    """Clip every reward into [-reward_clip, reward_clip] (counted as `reward/clipped`); None:
    off, and rewards beyond 1e6 in magnitude are only warned about."""
    max_reward_failure_rate: float = 0.5
    """Stop the run when more than this fraction of a rollout's samples fail their reward
    (raise, time out, or return a non-number or a non-finite one), naming the errors; 1: never."""

    def __post_init__(self) -> None:
        self._check_rm_type()
        self._check_type_specific_flags()
        self._check_numbers()

    def _check_rm_type(self) -> None:
        if self.rm_type in RM_TYPES:
            return
        close = difflib.get_close_matches(str(self.rm_type), RM_TYPES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"--rm-type {self.rm_type!r} is not a reward type{hint}; "
            f"choose from {', '.join(RM_TYPES)}"
        )

    def _check_type_specific_flags(self) -> None:
        rm = self.rm_type
        if rm == "custom" and not self.custom_rm_path:
            raise ValueError(
                "--rm-type custom needs --custom-rm-path naming the reward function, "
                "e.g. --custom-rm-path my_pkg.rewards:score"
            )
        if rm != "custom" and self.custom_rm_path is not None:
            raise ValueError(
                f"--custom-rm-path ({self.custom_rm_path!r}) is only used by --rm-type custom, "
                f"but --rm-type is {rm!r}; set --rm-type custom or drop --custom-rm-path"
            )
        if self.custom_rm_path is not None:
            try:  # syntax only: the module is imported by RewardHub, where the run needs it
                split_import_path(self.custom_rm_path, CUSTOM_RM_PATH_FLAG)
            except ImportPathError as err:
                raise ValueError(str(err)) from None
        if rm == "remote" and not self.rm_url:
            raise ValueError(
                "--rm-type remote needs --rm-url, the URL the reward model answers POSTs at, "
                "e.g. --rm-url http://rm-host:8000/score"
            )
        if rm != "remote" and self.rm_url is not None:
            raise ValueError(
                f"--rm-url ({self.rm_url!r}) is only used by --rm-type remote, but --rm-type is "
                f"{rm!r}; set --rm-type remote or drop --rm-url"
            )
        if self.rm_url is not None and not self.rm_url.startswith(("http://", "https://")):
            raise ValueError(
                f"--rm-url ({self.rm_url!r}) must be an http:// or https:// URL, "
                "e.g. http://rm-host:8000/score"
            )
        if rm != "remote" and self.rm_max_retries != _default("rm_max_retries"):
            raise ValueError(
                f"--rm-max-retries ({self.rm_max_retries}) only applies to --rm-type remote, but "
                f"--rm-type is {rm!r}; drop --rm-max-retries"
            )
        if rm in BUILTIN_RM_TYPES:
            for flag, value, why in (
                ("--group-rm", self.group_rm or None, "scores one sample at a time"),
                ("--reward-key", self.reward_key, "returns a number, not a dict"),
            ):
                if value is not None:
                    raise ValueError(
                        f"{flag} ({value!r}) only applies to --rm-type remote or custom; the "
                        f"built-in {rm!r} reward {why}: drop {flag}"
                    )

    def _check_numbers(self) -> None:
        if not (self.rm_timeout_s > 0 and math.isfinite(self.rm_timeout_s)):
            raise ValueError(
                f"--rm-timeout-s ({self.rm_timeout_s}) must be a positive number of seconds"
            )
        if self.rm_max_retries < 0:
            raise ValueError(
                f"--rm-max-retries ({self.rm_max_retries}) must be 0 or more; 0 disables retries"
            )
        if self.rm_concurrency < 1:
            raise ValueError(f"--rm-concurrency ({self.rm_concurrency}) must be at least 1")
        if self.reward_clip is not None and not (
            self.reward_clip > 0 and math.isfinite(self.reward_clip)
        ):
            raise ValueError(
                f"--reward-clip ({self.reward_clip}) must be a positive finite bound on the "
                "reward's magnitude, e.g. --reward-clip 10; drop it to leave rewards unclipped"
            )
        if self.reward_clip is not None and abs(self.reward_failure_score) > self.reward_clip:
            raise ValueError(
                f"--reward-failure-score ({self.reward_failure_score}) lies outside --reward-clip "
                f"({self.reward_clip}); choose a failure score within [-{self.reward_clip}, "
                f"{self.reward_clip}]"
            )
        if not 0 <= self.max_reward_failure_rate <= 1:
            raise ValueError(
                f"--max-reward-failure-rate ({self.max_reward_failure_rate}) must be a fraction "
                "in [0, 1]: 0 stops at the first failing reward, 1 never stops"
            )
        if not math.isfinite(self.reward_failure_score):
            raise ValueError(
                f"--reward-failure-score ({self.reward_failure_score}) must be a finite number: "
                "it becomes the reward, and a NaN or inf would poison the whole batch"
            )


def _default(name: str) -> object:
    return next(f.default for f in fields(RewardConfig) if f.name == name)
