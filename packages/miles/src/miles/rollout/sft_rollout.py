"""A rollout function for supervised fine-tuning: the dataset's labels are the responses.

Use with `--loss-type sft_loss --rollout-function-path miles.rollout.sft_rollout:sft_rollout`, so a
supervised warm-up runs through `miles train` like any RL stage (same data source, checkpoints,
evaluation and tracking). Each prompt's response is its label followed by the end-of-text token.

A warm-up for a tool rollout sets --tool-paths (with --apply-chat-template): each prompt is then
rendered as the tool rollout opens its exchange, with the tools shown (a row's chat may hold
earlier turns: a call and the tool's result, to teach the answer after it), and evaluation runs
the tool rollout's multi-turn episodes (`generate.sample_generator`).
"""

from __future__ import annotations

from typing import Any

from miles.backends.training_utils.batching.sample import Sample, SampleStatus
from miles.utils.tokenizers import load_tokenizer


def sft_rollout(
    rollout_id: int, *, pool: Any, data_source: Any, score_groups: Any, config: Any
) -> list[list[Sample]]:
    """`--rollout-batch-size` groups whose responses are the labels (no generation)."""
    del rollout_id, pool, score_groups  # nothing is generated or scored
    tokenizer = load_tokenizer(config.checkpoint.hf_checkpoint)
    agent = _tool_agent(config)
    groups = data_source.get_samples(config.rollout.rollout_batch_size)
    for group in groups:
        for sample in group:
            if sample.label is None:
                raise ValueError(
                    f"SFT needs a response for every prompt, but prompt {sample.group_index} has "
                    "no label; set --label-key to the column holding the responses"
                )
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
    return groups


def _tool_agent(config: Any) -> Any:
    if not config.rollout.tool_paths:
        return None
    from miles.rollout.tool_rollout import ToolAgent

    return ToolAgent.for_run(config)


def _tool_sample_generator(config: Any) -> Any:
    """With --tool-paths, evaluation runs the tool rollout's episodes (else the built-in way)."""
    agent = _tool_agent(config)
    return None if agent is None else agent.generate


sft_rollout.sample_generator = _tool_sample_generator  # type: ignore[attr-defined]
