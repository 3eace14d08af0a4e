"""A multi-turn exchange with an engine, token for token, as training sees it.

The token-exact rule of agentic rollouts (architecture.md: "Agentic rollouts"): what is trained on
is the concatenation of the ids the engine was given and the ids it produced, never a decoded and
re-rendered conversation, whose tokens can differ from those the policy sampled. A `Trajectory` is
built turn by turn from those ids: the model's completions are trained on (loss mask 1, with the
engine's log-probs), everything between them (tool results, user turns, the template's turn
markers) is context (loss mask 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.backends.training_utils.batching.sample import Sample


@dataclass
class Trajectory:
    prompt_ids: list[int]
    """The first prompt, as sent to the engine."""
    response_ids: list[int] = field(default_factory=list)
    """Everything after the first prompt: completions and the context between them."""
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    completions: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("a trajectory starts from a non-empty prompt")

    @property
    def ids(self) -> list[int]:
        """What the engine is given next: the whole exchange so far."""
        return [*self.prompt_ids, *self.response_ids]

    def add_completion(self, ids: list[int], log_probs: list[float]) -> None:
        """Ids the model produced, with the engine's log-prob of each: trained on."""
        if len(ids) != len(log_probs):
            raise ValueError(
                f"a completion of {len(ids)} tokens came with {len(log_probs)} log-probs"
            )
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.log_probs += [float(lp) for lp in log_probs]
        self.completions += 1

    def add_context(self, ids: list[int]) -> None:
        """Ids the model did not produce (tool results, a user's turn, turn markers): not trained
        on; their log-probs are placeholders the loss mask hides."""
        if self.completions == 0:
            raise ValueError("context before the first completion belongs in the prompt")
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)

    def fill(self, sample: Sample) -> Sample:
        """`sample` holding this trajectory: tokens, response length, loss mask, log-probs."""
        sample.tokens = self.ids
        sample.response_length = len(self.response_ids)
        sample.loss_mask = list(self.loss_mask)
        sample.rollout_log_probs = list(self.log_probs)
        sample.validate()
        return sample
