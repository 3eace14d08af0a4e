"""A rollout for supervised fine-tuning: the dataset's labels are the responses.

Use with `--loss-type sft_loss --rollout-function-path miles.rollout.sft_rollout:SftRollout`, so a
supervised warm-up runs through `miles train` like any RL stage (same data source, checkpoints,
evaluation and tracking). Each prompt's response is its label followed by the end-of-text token.

A warm-up for a tool rollout sets --tool-paths (with --apply-chat-template): each prompt is then
rendered as the tool rollout opens its exchange, with the tools shown (a row's chat may hold
earlier turns: a call and the tool's result, to teach the answer after it), and evaluation runs
the tool rollout's multi-turn episodes (`for_evaluation`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.backends.training_utils.batching.sample import Sample, SampleStatus
from miles.rollout.context import RolloutContext, RolloutOutput
from miles.rollout.contract import Rollout
from miles.rollout.single_turn import SingleTurnRollout
from miles.rollout.tool_rollout import ToolAgent, ToolRollout

if TYPE_CHECKING:
    from typing import Self

    from miles.rollout.data_source import DataSourceConfig
    from miles.rollout.rollout_config import RolloutConfig


class SftRollout(Rollout):
    """Groups whose responses are the labels: nothing is generated or scored."""

    def __init__(self, evaluation: Rollout) -> None:
        self.evaluation = evaluation

    @classmethod
    def from_config(cls, config: RolloutConfig) -> Self:
        """Evaluated with the tool rollout's episodes under --tool-paths, else the built-in way."""
        evaluation = ToolRollout() if config.tool_paths else SingleTurnRollout.from_config(config)
        return cls(evaluation)

    def check(self, rollout: RolloutConfig, data: DataSourceConfig) -> None:
        if rollout.tool_paths:  # the prompts are rendered, and evaluated, as the tool rollout's
            self.evaluation.check(rollout, data)

    async def generate_group(self, ctx: RolloutContext, group: list[Sample]) -> list[Sample]:
        agent = ToolAgent.for_context(ctx) if ctx.rollout.tool_paths else None
        return [_labelled(ctx, sample, agent) for sample in group]

    async def generate_rollout(self, ctx: RolloutContext, rollout_id: int) -> RolloutOutput:
        """`--rollout-batch-size` groups whose responses are the labels, unscored (the loss
        reads no reward)."""
        del rollout_id
        groups = ctx.data_source.get_samples(ctx.rollout.rollout_batch_size)
        return RolloutOutput(groups=[await self.generate_group(ctx, g) for g in groups], metrics={})

    def for_evaluation(self) -> Rollout:
        return self.evaluation


sft_rollout = SftRollout  # its name in earlier versions' --rollout-function-path


def _labelled(ctx: RolloutContext, sample: Sample, agent: ToolAgent | None) -> Sample:
    if sample.label is None:
        raise ValueError(
            f"SFT needs a response for every prompt, but prompt {sample.group_index} has "
            "no label; set --label-key to the column holding the responses"
        )
    tokenizer = ctx.tokenizer
    if agent is not None:  # the data source renders no tools: the tool rollout does
        sample.tokens = agent.first_prompt(sample)
    response_ids = tokenizer(sample.label, add_special_tokens=False)["input_ids"]
    response_ids.append(tokenizer.eos_token_id)
    sample.tokens = [*sample.tokens, *response_ids]
    sample.response = sample.label
    sample.response_length = len(response_ids)
    sample.loss_mask = [1] * len(response_ids)
    sample.status = SampleStatus.COMPLETED
    sample.reward = 0.0  # unused by sft_loss; the train batch needs a number
    return sample
