"""What a rollout is made with: `RolloutContext` (engines, data, scorer, settings, tokenizer) and
what it returns, `RolloutOutput`. The contract itself (`Rollout`) is in `miles.rollout.contract`.

One context describes one rollout being made: the training rollout of step N, or one evaluation
data set. Its `requests` are that rollout's request slots; `run_groups` gives each run fresh ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from miles.backends.training_utils.batching.sample import Sample

if TYPE_CHECKING:
    from miles.rollout.chat_template import ChatTemplate
    from miles.rollout.data_source import DataSourceConfig
    from miles.rollout.engine_pool import EnginePool
    from miles.rollout.rollout_config import RolloutConfig

__all__ = [
    "DataSource",
    "GroupGenerator",
    "RequestSlots",
    "RolloutContext",
    "RolloutOutput",
    "ScoreGroups",
]


@dataclasses.dataclass
class RolloutOutput:
    """The kept groups, in the order their prompts were submitted, and the rollout's metrics."""

    groups: list[list[Sample]]
    metrics: dict[str, float]


class DataSource(Protocol):
    """Where prompts come from (miles.rollout.data_source.RolloutDataSource)."""

    def get_samples(self, num_prompts: int) -> list[list[Sample]]: ...

    def add_samples(self, groups: list[list[Sample]]) -> None: ...


ScoreGroups = Callable[[list[list[Sample]]], Awaitable[Any]]
"""Sets `sample.reward` on every sample of the groups (the reward hub's `score_groups`)."""


class RequestSlots:
    """The bound on one rollout's engine requests in flight (--rollout-concurrency), and its
    stop: once the rollout has what it needs, a request still waiting for a slot is not sent."""

    def __init__(self, concurrency: int) -> None:
        self._semaphore = asyncio.Semaphore(concurrency)
        self.closed = False

    def close(self) -> None:
        """No request goes out after this; those already sent run on (until aborted)."""
        self.closed = True

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[bool]:
        """Hold one slot for a request; yields False when the rollout closed meanwhile (the
        caller then sends nothing and marks its samples aborted)."""
        async with self._semaphore:
            yield not self.closed


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutContext:
    """Everything a rollout reads: typed settings and shared objects, never the whole run config.

    Built by the rollout manager for each rollout it makes (training, and each evaluation set)."""

    pool: EnginePool
    """The engines: `await pool.generate(payload)` is one SGLang /generate call."""
    data_source: DataSource
    """Where this rollout's prompts come from (and where --partial-rollout leftovers go back)."""
    score_groups: ScoreGroups
    """Sets every sample's reward (the run's reward hub)."""
    rollout: RolloutConfig
    """This rollout's sampling settings (an evaluation's differ from training's)."""
    data: DataSourceConfig
    """How prompts were read: chat template, keys, --apply-chat-template."""
    tokenizer: Any
    """The checkpoint's tokenizer, loaded once per process (`miles.utils.tokenizers`)."""
    chat_template: ChatTemplate
    """How a chat is rendered (the data settings' template, read once)."""
    model_path: str
    """--hf-checkpoint: the served model's path (the name an OpenAI client asks for)."""
    processor: Any = None
    """The checkpoint's processor (`AutoProcessor`) when the data has images (--multimodal-keys):
    what turns a chat with images into token ids; None for text-only data."""
    requests: RequestSlots = dataclasses.field(init=False)
    """This rollout's request slots (--rollout-concurrency), made with the context; `run_groups`
    runs on a fresh copy of the context, so each of its runs has its own."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", RequestSlots(self.rollout.rollout_concurrency))

    def with_fresh_requests(self) -> RolloutContext:
        """The same context with new, open request slots (one set per rollout made)."""
        return dataclasses.replace(self)


GroupGenerator = Callable[[RolloutContext, list[Sample]], Awaitable[list[Sample]]]
"""`Rollout.generate_group`: makes every sample of one prompt's group (same length and order)."""
