"""Multi-turn rollouts with tools: the model answers, calls tools in Qwen's `<tool_call>` format,
reads their results and answers again, up to --max-turns, and the whole exchange is one sample.

Select it with `--rollout-function-path miles.rollout.tool_rollout:ToolRollout`, with
`--tool-paths` (the functions), `--apply-chat-template` (the chat the tools are shown in), and
optionally `--tool-key` (each row's own tools). The sample is token-exact (architecture.md:
"Agentic rollouts"): its tokens are the ids the engine read and wrote, the model's completions
are trained on and the tool results between them are not. Its `response` is the last answer,
which the reward scores; `metadata` counts turns, calls, failed calls by kind, and the turns a
fresh rendering of the chat would have written differently (`template_mismatches`).

A sample aborted part-way (a weight update with --partial-rollout) starts its exchange again,
with its whole token budget. A turn the engine refuses because the exchange no longer fits its
context ends the sample as truncated.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections import Counter
from typing import TYPE_CHECKING, Any

from miles.backends.sglang_utils.client import EngineError
from miles.backends.sglang_utils.tool_calls import parse_tool_calls
from miles.backends.training_utils.batching.sample import Sample, SampleStatus
from miles.rollout.chat_turns import ChatTurns
from miles.rollout.context import RolloutContext, RolloutOutput
from miles.rollout.engine_pool import EnginePool
from miles.rollout.sample_generation import as_weight_version, completion_of, finish_status
from miles.rollout.sample_rollout import SampleRollout
from miles.rollout.tools import Tool, call_tool, load_tools
from miles.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from miles.rollout.data_source import DataSourceConfig
    from miles.rollout.rollout_config import RolloutConfig

FAILURES = ("unknown tool", "bad arguments", "raised", "timeout")


class ToolRollout(SampleRollout):
    """The multi-turn rollout with tools: each sample is one exchange (`ToolAgent.generate`), and
    a training rollout's metrics add the exchanges' counts."""

    def check(self, rollout: RolloutConfig, data: DataSourceConfig) -> None:
        if not rollout.tool_paths:
            raise ValueError(
                "miles.rollout.tool_rollout needs --tool-paths: the functions the policy may call"
            )
        if not data.apply_chat_template:
            raise ValueError(
                "miles.rollout.tool_rollout shows the tools through the chat template: pass "
                "--apply-chat-template"
            )

    async def generate_sample(
        self, ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]
    ) -> Sample:
        return await ToolAgent.for_context(ctx).generate(ctx.pool, sample, sampling_params)

    async def generate_rollout(self, ctx: RolloutContext, rollout_id: int) -> RolloutOutput:
        output = await super().generate_rollout(ctx, rollout_id)
        output.metrics.update(agent_metrics([s for group in output.groups for s in group]))
        return output


generate_tool_rollout = ToolRollout  # its name in earlier versions' --rollout-function-path


def agent_metrics(samples: list[Sample]) -> dict[str, float]:
    """Per-sample means of the exchanges' tool calls and template mismatches, and the failed
    calls by kind. (Turns are every multi-turn rollout's: `train_data.rollout_metrics`.)"""
    count = max(len(samples), 1)
    totals = Counter()
    for sample in samples:
        totals.update({k: sample.metadata.get(k, 0) for k in ("tool_calls", "template_mismatches")})
        totals.update(sample.metadata.get("tool_failures", {}))
    keys = ("tool_calls", "template_mismatches")
    metrics = {f"rollout/{k}_mean": totals[k] / count for k in keys}
    for kind in FAILURES:
        metrics[f"rollout/tool_failures/{kind.replace(' ', '_')}"] = float(totals[kind])
    return metrics


class ToolAgent:
    """Everything a multi-turn sample needs: the tokenizer and chat template of the run, the
    tools, the turn and time bounds."""

    def __init__(self, tokenizer: Any, template: Any, tools: dict[str, Tool], *,
                 max_turns: int, timeout_s: float, processor: Any = None) -> None:  # fmt: skip
        self.tokenizer, self.template, self.tools = tokenizer, template, tools
        self.max_turns, self.timeout_s = max_turns, timeout_s
        self.processor = processor  # a VLM's, for prompts with images

    @classmethod
    def for_context(cls, ctx: RolloutContext) -> ToolAgent:
        """The agent of a rollout: its tokenizer, chat template, tools and bounds (the tool
        rollout's `check` has made sure they are there)."""
        rollout = ctx.rollout
        assert rollout.tool_paths, "ToolRollout.check refuses a run without --tool-paths"
        return cls(
            ctx.tokenizer,
            ctx.chat_template,
            _tools(tuple(rollout.tool_paths)),
            max_turns=rollout.max_turns,
            timeout_s=rollout.tool_timeout_s,
            processor=ctx.processor,
        )

    def _offered(self, sample: Sample) -> dict[str, Tool]:
        names = sample.metadata.get("tools")
        if names is None:
            return self.tools
        unknown = sorted(set(names) - set(self.tools))
        if unknown:
            raise ValueError(
                f"sample {sample.index} (prompt {sample.group_index}) offers tools {unknown} that "
                f"--tool-paths does not define (it has {sorted(self.tools)}); fix the --tool-key "
                "column or add them"
            )
        return {name: self.tools[name] for name in names}

    def _chat(self, sample: Sample) -> tuple[dict[str, Tool], ChatTurns]:
        """The tools `sample` may call, and its chat rendered with them."""
        if sample.messages is None:
            raise ValueError(
                f"sample {sample.index} has no chat messages: pass --apply-chat-template"
            )
        offered = self._offered(sample)
        specs = [t.spec for t in offered.values()] or None
        chat = ChatTurns(self.tokenizer, self.template, specs, self.processor)
        return offered, chat

    def first_prompt(self, sample: Sample) -> list[int]:
        """The ids the exchange of `sample` opens with: its chat, with the tools it may call
        shown, and the generation prompt (what a supervised warm-up trains after)."""
        return self._chat(sample)[1].first(sample.messages, sample.images)

    async def generate(self, pool: EnginePool, sample: Sample, params: dict[str, Any]) -> Sample:
        """The exchange for one sample (a GenerateFunction)."""
        offered, chat = self._chat(sample)
        conversation = list(sample.messages)
        trajectory = Trajectory(chat.first(conversation, sample.images))
        # A sample aborted part-way was handed back reset (below): it has its whole budget.
        budget, status, answer = params["max_new_tokens"], SampleStatus.TRUNCATED, ""
        failures: Counter = Counter()
        calls_made = mismatches = 0
        for turn in range(self.max_turns):
            left = budget - len(trajectory.response_ids)
            if left <= 0:
                break
            turn_params = {**params, "max_new_tokens": left}
            if params.get("sampling_seed") is not None:
                turn_params["sampling_seed"] = params["sampling_seed"] + turn
            payload = {"input_ids": trajectory.ids, "sampling_params": turn_params,
                       "return_logprob": True}  # fmt: skip
            if sample.images:  # the prompt's images, in every turn: its ids hold their tokens
                payload["image_data"] = sample.images
            try:
                response = await pool.generate(payload)
            except EngineError as err:
                if err.status != 400 or turn == 0:  # the first prompt is the data's to fit
                    raise
                sample.metadata["engine_refusal"] = str(err)[:500]
                status = SampleStatus.TRUNCATED  # the exchange outgrew the engine's context
                break
            ids, log_probs = completion_of(response)
            trajectory.add_completion(ids, log_probs)
            meta = response.get("meta_info") or {}
            if meta.get("weight_version") is not None:
                sample.weight_version = as_weight_version(meta["weight_version"])
            answer = response.get("text") or ""
            status = finish_status(response)
            calls = (
                parse_tool_calls(answer, set(offered)).tool_calls
                if status == SampleStatus.COMPLETED
                else []
            )
            if turn > 0:  # the first prompt is the template's own rendering
                sent = trajectory.ids[: len(trajectory.ids) - len(ids)]
                mismatches += not await asyncio.to_thread(
                    chat.matches_template, conversation, sent, sample.images
                )
            conversation.append(_assistant_message(answer, calls))
            if status == SampleStatus.ABORTED or not calls:
                break
            if turn == self.max_turns - 1:
                status = SampleStatus.TRUNCATED  # still calling tools when the turns ran out
                break
            results = [await call_tool(offered, c.name, c.arguments, self.timeout_s) for c in calls]
            calls_made += len(calls)
            failures.update(r.failure for r in results if r.failure)
            replies = [{"role": "tool", "name": c.name, "tool_call_id": c.id, "content": r.text}
                       for c, r in zip(calls, results, strict=True)]  # fmt: skip
            context = chat.after(ids, replies)
            if len(trajectory.response_ids) + len(context) >= budget:
                status = SampleStatus.TRUNCATED  # no room left to answer the results
                break
            trajectory.add_context(context)
            conversation += replies
        if status == SampleStatus.ABORTED:
            # Aborted part-way: handed back as the prompt alone, so a resumed rollout starts the
            # exchange again with its whole budget (the engine's ids so far are not kept).
            sample.tokens, sample.response_length = list(trajectory.prompt_ids), 0
            sample.rollout_log_probs = sample.loss_mask = None
            sample.response, sample.status = "", status
            return sample
        trajectory.fill(sample)
        sample.response, sample.status = answer, status
        sample.metadata.update(
            turns=trajectory.completions, tool_calls=calls_made, tool_failures=dict(failures),
            template_mismatches=mismatches,
        )  # fmt: skip
        return sample


def _assistant_message(text: str, calls: list) -> dict[str, Any]:
    if not calls:
        return {"role": "assistant", "content": text}
    content = text[: text.index("<tool_call>")].rstrip()
    tool_calls = [{"id": c.id, "type": "function",
                   "function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in calls]  # fmt: skip
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}


@functools.cache
def _tools(paths: tuple[str, ...]) -> dict[str, Tool]:
    return load_tools(list(paths))
