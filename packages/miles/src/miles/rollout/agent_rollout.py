"""Rollouts made by agents: your code drives each sample's conversation through an OpenAI
client, and miles records it token-exactly.

    async def run(client: openai.AsyncOpenAI, sample: Sample) -> str | None

Select it with `--rollout-function-path miles.rollout.agent_rollout:AgentRollout
--agent-function-path my_agent:run --apply-chat-template`. For each sample miles opens a session
on its session server (`session_server.py`), hands `run` a client whose base URL is that
session's, and awaits it for at most --session-timeout-s. `sample.messages` is the row's chat;
`sample.label` and `sample.metadata` are the row's too, and what `run` writes into
`sample.metadata` reaches the reward function. `run` returns the answer to score
(`sample.response`), or None for the session's last answer.

The sample is the session's trajectory (`AgentSession`): the ids the engine read and wrote, the
model's own tokens trained on (loss mask 1), everything else not. How the session ended is
`sample.metadata["session_end"]`: `completed` (status of the last turn), `turn_limit`,
`token_limit`, `context_limit` (status `truncated`), `timeout`, `error` (status `failed`: loss
mask 0, the traceback's last line in `metadata["session_error"]`), or `aborted` (the sample is
handed back as its prompt, to start again).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from collections import Counter
from typing import TYPE_CHECKING, Any

from miles.backends.sglang_utils.token_spelling import TokenSpelling
from miles.backends.training_utils.batching.sample import Sample, SampleStatus
from miles.rollout.agent_function import load_agent
from miles.rollout.agent_session import AgentSession, SessionEnd
from miles.rollout.context import RolloutContext, RolloutOutput
from miles.rollout.engine_pool import EnginePool
from miles.rollout.sample_rollout import SampleRollout
from miles.rollout.session_server import SessionServer

if TYPE_CHECKING:
    from miles.rollout.data_source import DataSourceConfig
    from miles.rollout.rollout_config import RolloutConfig

logger = logging.getLogger(__name__)

# One session server per event loop (the rollout manager has one loop; a test may have several),
# held as the task that starts it: every sample's session may ask for it at once, and none may
# get a server that is not listening yet.
_servers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task[SessionServer]] = (
    weakref.WeakKeyDictionary()
)


async def session_server(host: str, model_name: str) -> SessionServer:
    """The running loop's session server, started on first use; every caller waits for it to
    listen. A failed start is forgotten, so the next caller tries again."""
    loop = asyncio.get_running_loop()
    starting = _servers.get(loop)
    if starting is None:
        starting = _servers[loop] = loop.create_task(_start(SessionServer(host, model_name)))
    try:
        return await asyncio.shield(starting)
    except BaseException:
        if starting.done() and _servers.get(loop) is starting:
            del _servers[loop]
        raise


async def close_session_server() -> None:
    """Stop the running loop's session server, if one was started."""
    starting = _servers.pop(asyncio.get_running_loop(), None)
    if starting is not None:
        await (await starting).aclose()


async def _start(server: SessionServer) -> SessionServer:
    await server.start()
    return server


@functools.lru_cache(maxsize=4)
def _spelling(tokenizer: Any) -> TokenSpelling:
    """One token spelling table per tokenizer: it fills as sessions spell tokens."""
    return TokenSpelling(tokenizer)


class AgentRollout(SampleRollout):
    """Rollouts made by agents: each sample is one session of --agent-function-path's agent
    (`AgentRunner.generate`), and a training rollout's metrics add the sessions' counts."""

    def check(self, rollout: RolloutConfig, data: DataSourceConfig) -> None:
        if not rollout.agent_function_path:
            raise ValueError(
                "miles.rollout.agent_rollout needs --agent-function-path: the agent that drives "
                "each sample's session"
            )
        if not data.apply_chat_template:
            raise ValueError(
                "miles.rollout.agent_rollout renders sessions with the chat template: pass "
                "--apply-chat-template"
            )

    async def generate_sample(
        self, ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]
    ) -> Sample:
        runner = await AgentRunner.for_context(ctx)
        return await runner.generate(ctx.pool, sample, sampling_params)

    async def generate_rollout(self, ctx: RolloutContext, rollout_id: int) -> RolloutOutput:
        output = await super().generate_rollout(ctx, rollout_id)
        output.metrics.update(session_metrics([s for group in output.groups for s in group]))
        return output


generate_agent_rollout = AgentRollout  # its name in earlier versions' --rollout-function-path


def session_metrics(samples: list[Sample]) -> dict[str, float]:
    """Per-sample means of the sessions' template mismatches and history rewrites, and how many
    sessions ended each way. (Turns are every multi-turn rollout's: `train_data.rollout_metrics`.)"""
    count = max(len(samples), 1)
    totals: Counter = Counter()
    ends: Counter = Counter()
    for sample in samples:
        totals.update({k: sample.metadata.get(k, 0)
                       for k in ("template_mismatches", "history_rewrites")})  # fmt: skip
        ends[sample.metadata.get("session_end")] += 1
    metrics = {f"rollout/{k}_mean": totals[k] / count
               for k in ("template_mismatches", "history_rewrites")}  # fmt: skip
    for end in SessionEnd:
        metrics[f"rollout/session_end/{end}"] = float(ends[str(end)])
    return metrics


class AgentRunner:
    """What every session of a run shares: the agent, the tokenizer and chat template, the
    session server, the bounds."""

    def __init__(self, agent: Any, tokenizer: Any, template: Any, server: SessionServer, *,
                 max_turns: int, timeout_s: float, processor: Any = None) -> None:  # fmt: skip
        self.agent, self.tokenizer, self.template, self.server = agent, tokenizer, template, server
        self.max_turns, self.timeout_s = max_turns, timeout_s
        self.processor = processor  # a VLM's: sessions may then send images
        self.spelling = _spelling(tokenizer)

    @classmethod
    async def for_context(cls, ctx: RolloutContext) -> AgentRunner:
        """The runner of a rollout: its agent, tokenizer, chat template, the loop's session
        server and the bounds (the agent rollout's `check` has made sure they are there)."""
        rollout = ctx.rollout
        assert rollout.agent_function_path, "AgentRollout.check refuses a run without an agent"
        server = await session_server(rollout.session_server_host, ctx.model_path)
        return cls(
            load_agent(rollout.agent_function_path), ctx.tokenizer, ctx.chat_template,
            server, max_turns=rollout.max_turns, timeout_s=rollout.session_timeout_s,
            processor=ctx.processor,
        )  # fmt: skip

    async def generate(self, pool: EnginePool, sample: Sample, params: dict[str, Any]) -> Sample:
        """One sample's session (a GenerateFunction)."""
        import openai  # an optional dependency: miles[agents]

        if sample.messages is None:
            raise ValueError(
                f"sample {sample.index} has no chat messages: pass --apply-chat-template"
            )
        session = AgentSession(pool, self.tokenizer, self.template, params,
                               max_turns=self.max_turns, spelling=self.spelling,
                               processor=self.processor)  # fmt: skip
        client = openai.AsyncOpenAI(
            base_url=self.server.open(session), api_key="miles-session", max_retries=0,
            timeout=self.timeout_s,
        )  # fmt: skip
        end, answer = SessionEnd.COMPLETED, None
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                answer = await self.agent(client, sample)
            if answer is not None and not isinstance(answer, str):
                raise TypeError(
                    f"the agent returned a {type(answer).__name__}; return the answer to score "
                    "(a str) or None (the session's last answer)"
                )
        except Exception as err:  # the agent's failure is the sample's, not the rollout's
            end, answer = SessionEnd.ERROR, None
            if deadline.expired():
                end = SessionEnd.TIMEOUT
            sample.metadata["session_error"] = f"{type(err).__name__}: {err}"[:1000]
        finally:
            await self.server.close(session)
            await client.close()
        if session.engine_failure is not None:
            raise session.engine_failure  # the rollout's: a lost engine's group is sent again
        if session.aborted:
            # Handed back as its prompt: a resumed rollout runs the whole session again.
            sample.response_length, sample.response, sample.status = 0, "", SampleStatus.ABORTED
            sample.rollout_log_probs = sample.loss_mask = None
            return sample
        if end == SessionEnd.ERROR and session.limit is None:
            logger.warning(
                "sample %s: agent failed: %s", sample.index, sample.metadata["session_error"]
            )
        return session.fill(sample, end, answer)
