"""One generated answer to one prompt, as the rollout side hands it to training.

(architecture.md: "Contracts / Data")

A `Sample` is row-shaped and mutable while a rollout fills it in; training works on the columnar
`RolloutBatch` built from a list of them (`rollout_data.samples_to_rollout_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class SampleStatus(StrEnum):
    """How generation of a sample ended."""

    COMPLETED = "completed"
    """The engine stopped on a stop token or stop string."""
    TRUNCATED = "truncated"
    """The response hit the length limit."""
    ABORTED = "aborted"
    """Generation was aborted (e.g. by a weight update or a cancelled request)."""
    FAILED = "failed"
    """The code making the sample failed (an agent that raised, a session past its time): it
    holds what was recorded before, with a loss mask of 0, so it trains nothing."""


@dataclass(kw_only=True)
class Sample:
    """A prompt and one response to it, with everything training needs about how it was made.

    `tokens` holds the prompt token ids followed by the response token ids; the last
    `response_length` of them are the response. Per-response-token lists (`rollout_log_probs`,
    `loss_mask`) have exactly `response_length` entries.
    """

    index: int | None = None
    """Position of this sample in the rollout, unique within it; set before training."""
    group_index: int | None = None
    """Index of the prompt this sample answers; samples of one prompt share it (GRPO groups)."""
    prompt: str = ""
    """The prompt text, as rendered for the model (chat template applied)."""
    tokens: list[int] = field(default_factory=list)
    """Prompt token ids followed by response token ids."""
    response: str = ""
    """The decoded response text."""
    response_length: int = 0
    """How many of the trailing `tokens` are the response."""
    label: str | None = None
    """Ground truth the reward function compares against, if the task has one."""
    reward: float | None = None
    """The scalar reward training uses, after any shaping (e.g. an overlong penalty)."""
    raw_reward: float | None = None
    """The reward function's own output before shaping, for logging; None means equal to `reward`."""
    status: SampleStatus = SampleStatus.COMPLETED
    """How generation ended."""
    rollout_log_probs: list[float] | None = None
    """Log-probability the inference engine gave each response token; None if not requested."""
    loss_mask: list[int] | None = None
    """1 for response tokens trained on, 0 for the rest (e.g. tool output); None means all ones."""
    teacher_log_probs: list[float] | None = None
    """Log-probability a teacher model gives each response token (on-policy distillation,
    --use-opd); None without a teacher."""
    teacher_top_ids: list[list[int]] | None = None
    """The teacher's K likeliest tokens at each response position, likeliest first
    (--opd-kl-mode topk); None otherwise."""
    teacher_top_log_probs: list[list[float]] | None = None
    """The teacher's log-probs of `teacher_top_ids`, position by position."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form per-sample data for custom rollout and reward functions."""
    messages: list[dict[str, Any]] | None = None
    """The prompt as chat messages, when a chat template rendered it: what a multi-turn rollout
    continues the conversation from."""
    images: list[str] | None = None
    """The prompt's images, in the order their tokens appear in `tokens`, each as SGLang's
    `image_data` carries it (a data: URL or base64 of the file); None for a text-only prompt.
    The engine and the trainer decode the same bytes with the model's processor."""
    routed_experts: str | None = None
    """A MoE model's routing as the engine reported it (SGLang's `meta_info["routed_experts"]`:
    base64 of int32 (len(tokens) - 1, layers, top_k)); what routing replay (R3) trains with."""
    weight_version: int | None = None
    """The engine's weight version that generated the response (architecture.md: "Contracts /
    Weight sync")."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the invariants between fields; called on construction and before training.

        A rollout fills a sample in after construction, so `samples_to_rollout_batch` calls this
        again rather than trusting the state checked at `__init__`.
        """
        try:
            self.status = SampleStatus(self.status)
        except ValueError:
            valid = ", ".join(s.value for s in SampleStatus)
            raise ValueError(
                f"sample {self.index}: status {self.status!r} is not one of {valid}"
            ) from None
        if not 0 <= self.response_length <= len(self.tokens):
            raise ValueError(
                f"sample {self.index}: response_length ({self.response_length}) must be between 0 "
                f"and len(tokens) ({len(self.tokens)}); tokens holds the prompt followed by the "
                "response, so append the response token ids to tokens"
            )
        self._check_per_token("rollout_log_probs", self.rollout_log_probs)
        self._check_per_token("loss_mask", self.loss_mask)
        self._check_per_token("teacher_log_probs", self.teacher_log_probs)
        self._check_teacher_top()
        if self.loss_mask is not None and any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(
                f"sample {self.index}: loss_mask must hold only 0 and 1, got "
                f"{sorted(set(self.loss_mask))}"
            )

    def _check_teacher_top(self) -> None:
        ids, log_probs = self.teacher_top_ids, self.teacher_top_log_probs
        if (ids is None) != (log_probs is None):
            raise ValueError(
                f"sample {self.index}: teacher_top_ids and teacher_top_log_probs come together "
                "(the teacher's top tokens and their log-probs); set both or neither"
            )
        if ids is None or log_probs is None:
            return
        self._check_per_token("teacher_top_ids", ids)
        self._check_per_token("teacher_top_log_probs", log_probs)
        widths = {len(row) for row in ids} | {len(row) for row in log_probs}
        if len(widths) > 1 or 0 in widths:
            raise ValueError(
                f"sample {self.index}: teacher_top_ids and teacher_top_log_probs need the same "
                f"number (K >= 1) of tokens at every response position, got {sorted(widths)}"
            )

    def _check_per_token(self, name: str, values: list[Any] | None) -> None:
        if values is not None and len(values) != self.response_length:
            raise ValueError(
                f"sample {self.index}: len({name}) ({len(values)}) must equal response_length "
                f"({self.response_length}): one entry per response token"
            )

    @property
    def prompt_length(self) -> int:
        """Number of prompt tokens at the start of `tokens`."""
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        """The response token ids (the last `response_length` of `tokens`)."""
        return self.tokens[self.prompt_length :]

    @property
    def effective_loss_mask(self) -> list[int]:
        """`loss_mask`, or all ones when it is None."""
        if self.loss_mask is None:
            return [1] * self.response_length
        return list(self.loss_mask)
