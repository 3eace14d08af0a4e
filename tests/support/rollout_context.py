"""A `RolloutContext` for tests that drive a rollout without a rollout manager."""

from __future__ import annotations

from typing import Any

from miles.rollout.context import RolloutContext
from miles.rollout.data_source import DataSourceConfig
from miles.rollout.rollout_config import RolloutConfig


def rollout_context(
    pool: Any,
    data_source: Any,
    score_groups: Any,
    config: RolloutConfig,
    *,
    tokenizer: Any = None,
    data: DataSourceConfig | None = None,
    model_path: str = "",
) -> RolloutContext:
    """What the rollout manager would hand a rollout made with `config` from `data_source`
    (`data`: the data settings; by default those of a file never read)."""
    data = data or DataSourceConfig(prompt_data="unread.jsonl")
    return RolloutContext(
        pool=pool,
        data_source=data_source,
        score_groups=score_groups,
        rollout=config,
        data=data,
        tokenizer=tokenizer,
        chat_template=data.chat_template,
        model_path=model_path,
    )
