"""Rollouts made by agents: your code drives each sample's conversation through an OpenAI
client, and miles records it token-exactly.

    async def run(client: openai.AsyncOpenAI, sample: Sample) -> str | None

Select it with `--rollout-function-path miles.rollout.agent_rollout:generate_agent_rollout
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
import inspect
import logging
import weakref
from collections import Counter
from typing import TYPE_CHECKING, Any

from miles.backends.sglang_utils.token_spelling import TokenSpelling
from miles.backends.training_utils.import_path import ImportPathError, load_function
from miles.backends.training_utils.sample import Sample, SampleStatus
from miles.rollout.agent_session import AgentSession, SessionEnd
from miles.rollout.engine_pool import EnginePool
from miles.rollout.generate import DataSource, RolloutOutput, ScoreGroups, generate_groups
from miles.rollout.sample_generation import GenerateFunction
from miles.rollout.session_server import SessionServer
from miles.utils.tokenizers import load_tokenizer

if TYPE_CHECKING:
    from miles.config.miles_config import MilesConfig

logger = logging.getLogger(__name__)

AGENT_FLAG = "--agent-function-path"

# One session server per event loop (the rollout manager has one loop; a test may have several).
_servers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SessionServer] = (
    weakref.WeakKeyDictionary()
)


def load_agent(path: str) -> Any:
    """The agent function `path` names; it must be `async def run(client, sample)`."""
    agent = load_function(path, AGENT_FLAG)
    if not inspect.iscoroutinefunction(agent):
        raise ImportPathError(
            f"{AGENT_FLAG} {path!r} names a plain function; an agent is "
            "`async def run(client, sample) -> str | None`"
        )
    return agent


async def session_server(host: str, model_name: str) -> SessionServer:
    """The running loop's session server, started on first use."""
    loop = asyncio.get_running_loop()
    server = _servers.get(loop)
    if server is None:
        server = _servers[loop] = SessionServer(host, model_name)
        try:
            await server.start()
        except BaseException:
            del _servers[loop]
            raise
    return server


async def generate_agent_rollout(
    rollout_id: int,
    *,
    pool: EnginePool,
    data_source: DataSource,
    score_groups: ScoreGroups,
    config: MilesConfig,
) -> RolloutOutput:
    """A rollout function (--rollout-function-path): `generate_groups` with each sample made by
    the agent over a session, and the sessions' counts added to the rollout's metrics."""
    runner = await AgentRunner.for_run(config)
    output = await generate_groups(
        pool, data_source, score_groups, config.rollout, rollout_id=rollout_id,
        generate_fn=runner.generate,
    )  # fmt: skip
    output.metrics.update(session_metrics([s for group in output.groups for s in group]))
    return output


async def agent_sample_generator(config: MilesConfig) -> GenerateFunction:
    """One sample's session with the run's agent: what evaluation makes held-out samples with
    (`generate.sample_generator`), so an agent run is evaluated over the same sessions."""
    return (await AgentRunner.for_run(config)).generate


generate_agent_rollout.sample_generator = agent_sample_generator  # type: ignore[attr-defined]


def session_metrics(samples: list[Sample]) -> dict[str, float]:
    """Per-sample means of the sessions' turns, template mismatches and history rewrites, and
    how many sessions ended each way."""
    count = max(len(samples), 1)
    totals: Counter = Counter()
    ends: Counter = Counter()
    for sample in samples:
        totals.update({k: sample.metadata.get(k, 0)
                       for k in ("turns", "template_mismatches", "history_rewrites")})  # fmt: skip
        ends[sample.metadata.get("session_end")] += 1
    metrics = {f"rollout/{k}_mean": totals[k] / count
               for k in ("turns", "template_mismatches", "history_rewrites")}  # fmt: skip
    for end in SessionEnd:
        metrics[f"rollout/session_end/{end}"] = float(ends[str(end)])
    return metrics


class AgentRunner:
    """What every session of a run shares: the agent, the tokenizer and chat template, the
    session server, the bounds."""

    def __init__(self, agent: Any, tokenizer: Any, template: Any, server: SessionServer, *,
                 max_turns: int, timeout_s: float) -> None:  # fmt: skip
        self.agent, self.tokenizer, self.template, self.server = agent, tokenizer, template, server
        self.max_turns, self.timeout_s = max_turns, timeout_s
        self.spelling = TokenSpelling(tokenizer)

    @classmethod
    async def for_run(cls, config: MilesConfig) -> AgentRunner:
        rollout = config.rollout
        if not rollout.agent_function_path:
            raise ValueError(
                "miles.rollout.agent_rollout needs --agent-function-path: the agent that drives "
                "each sample's session"
            )
        if not config.data.apply_chat_template:
            raise ValueError(
                "miles.rollout.agent_rollout renders sessions with the chat template: pass "
                "--apply-chat-template"
            )
        path = config.checkpoint.hf_checkpoint
        server = await session_server(rollout.session_server_host, path)
        return cls(
            load_agent(rollout.agent_function_path), load_tokenizer(path), config.data.chat_template,
            server, max_turns=rollout.max_turns, timeout_s=rollout.session_timeout_s,
        )  # fmt: skip

    async def generate(self, pool: EnginePool, sample: Sample, params: dict[str, Any]) -> Sample:
        """One sample's session (a GenerateFunction)."""
        import openai  # an optional dependency: miles[agents]

        if sample.messages is None:
            raise ValueError(
                f"sample {sample.index} has no chat messages: pass --apply-chat-template"
            )
        session = AgentSession(pool, self.tokenizer, self.template, params,
                               max_turns=self.max_turns, spelling=self.spelling)  # fmt: skip
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
