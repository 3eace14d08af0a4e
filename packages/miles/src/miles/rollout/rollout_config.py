"""The rollout's settings (`--rollout-*`, dynamic sampling, partial rollout), checked when built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles.backends.training_utils.infra.import_path import split_import_path
from miles.rollout.agent_function import load_agent
from miles.rollout.filters import check_filter_path
from miles.rollout.tools import load_tools

ROLLOUT_FUNCTION_FLAG = "--rollout-function-path"
GENERATE_FLAG = "--custom-generate-function-path"
DEFAULT_ROLLOUT_FUNCTION = "miles.rollout.single_turn:SingleTurnRollout"


@dataclass(kw_only=True)
class RolloutConfig:
    """How one rollout samples, filters and bounds its requests."""

    rollout_batch_size: int
    """--rollout-batch-size: prompts (groups) per rollout kept for training."""
    n_samples_per_prompt: int = 1
    """--n-samples-per-prompt: answers sampled per prompt (the group size, e.g. for GRPO's group
    baseline); the data source serves each prompt as a group of this many samples."""
    over_sampling_batch_size: int | None = None
    """--over-sampling-batch-size: prompts submitted per round when a dynamic filter is set
    (>= --rollout-batch-size); None means --rollout-batch-size."""
    rollout_max_response_len: int = 1024
    """--rollout-max-response-len: response token budget of a sample (max_new_tokens)."""
    rollout_temperature: float = 1.0
    """--rollout-temperature."""
    rollout_top_p: float = 1.0
    """--rollout-top-p."""
    rollout_top_k: int = -1
    """--rollout-top-k: -1 disables it."""
    rollout_stop: list[str] | None = None
    """--rollout-stop: stop strings (kept in the response text, so text and tokens agree)."""
    rollout_stop_token_ids: list[int] | None = None
    """--rollout-stop-token-ids: stop tokens besides the model's EOS."""
    rollout_concurrency: int = 64
    """--rollout-concurrency: most /generate requests in flight at once."""
    dynamic_sampling_filter_path: str | None = None
    """--dynamic-sampling-filter-path: "pkg.mod:fn", fn(group) -> bool (True keeps it), or a
    built-in name: "nonzero_std" drops groups whose rewards are all equal."""
    partial_rollout: bool = False
    """--partial-rollout: leftover groups go back to the data source and aborted samples resume
    from their partial response in the next rollout, instead of being dropped; with
    --fully-async, requests in flight at a weight update continue on the new weights."""
    return_routed_experts: bool = False
    """--return-routed-experts: ask the engines for each token's MoE experts and keep them on the
    sample (set by --use-rollout-routing-replay, which trains with them)."""
    mask_offpolicy_in_partial_rollout: bool = False
    """--mask-offpolicy-in-partial-rollout: with --fully-async --partial-rollout, the response
    tokens made by older weights than a sample's newest get loss mask 0."""
    custom_generate_function_path: str | None = None
    """--custom-generate-function-path: "pkg.mod:fn", async fn(pool, sample, sampling_params) ->
    Sample, making each sample of the built-in single-turn rollout in place of one /generate."""
    rollout_function_path: str = DEFAULT_ROLLOUT_FUNCTION
    """--rollout-function-path: "pkg.mod:Class", the rollout (a miles.rollout.contract.Rollout
    subclass): miles.rollout.tool_rollout:ToolRollout, miles.rollout.agent_rollout:AgentRollout,
    miles.rollout.sft_rollout:SftRollout for a supervised warm-up, or your own. A function of
    earlier versions, fn(rollout_id, *, pool, data_source, score_groups, config) returning a
    RolloutOutput or a list of groups, still works (its unscored samples are scored by the
    reward hub)."""
    rollout_seed: int = 42
    """--rollout-seed: seeds the prompt order and every request's sampler (`sampling_seed`), so
    a resumed run samples what the uninterrupted one would have."""
    tool_paths: list[str] | None = None
    """--tool-paths: "pkg.mod:fn" functions the policy may call in a multi-turn rollout
    (--rollout-function-path miles.rollout.tool_rollout:ToolRollout); each parameter
    annotated with int, float, str, bool, list or dict."""
    max_turns: int = 4
    """--max-turns: model turns of one multi-turn sample; a sample still calling tools after the
    last is truncated."""
    tool_timeout_s: float = 10.0
    """--tool-timeout-s: how long one tool call may take; past it the model reads an error."""
    agent_function_path: str | None = None
    """--agent-function-path: "pkg.mod:fn", `async def run(client, sample) -> str | None`, an
    agent driving each sample's conversation through an OpenAI client (--rollout-function-path
    miles.rollout.agent_rollout:AgentRollout); needs the `openai` package
    (miles[agents])."""
    session_timeout_s: float = 600.0
    """--session-timeout-s: how long one agent session may run; past it the sample is failed."""
    session_server_host: str = "127.0.0.1"
    """--session-server-host: the address the agents' session server listens on (a free port);
    an agent in another process on the machine reaches its session there."""

    def __post_init__(self) -> None:
        for flag, value, least in (
            ("--rollout-batch-size", self.rollout_batch_size, 1),
            ("--n-samples-per-prompt", self.n_samples_per_prompt, 1),
            ("--rollout-max-response-len", self.rollout_max_response_len, 1),
            ("--rollout-concurrency", self.rollout_concurrency, 1),
            ("--max-turns", self.max_turns, 1),
        ):
            if value < least:
                raise ValueError(f"{flag} ({value}) must be at least {least}")
        for flag, seconds in (("--tool-timeout-s", self.tool_timeout_s),
                              ("--session-timeout-s", self.session_timeout_s)):  # fmt: skip
            if not seconds > 0:
                raise ValueError(f"{flag} ({seconds}) must be positive")
        self._load_user_functions()
        if self.rollout_temperature < 0:
            raise ValueError(
                f"--rollout-temperature ({self.rollout_temperature}) must be >= 0 (0 is greedy)"
            )
        if not 0 < self.rollout_top_p <= 1:
            raise ValueError(f"--rollout-top-p ({self.rollout_top_p}) must be in (0, 1]")
        if self.rollout_top_k != -1 and self.rollout_top_k < 1:
            raise ValueError(f"--rollout-top-k ({self.rollout_top_k}) must be -1 (off) or >= 1")
        self._check_filter_flags()
        if self.custom_generate_function_path is not None:
            split_import_path(self.custom_generate_function_path, GENERATE_FLAG)
        split_import_path(self.rollout_function_path, ROLLOUT_FUNCTION_FLAG)

    def _load_user_functions(self) -> None:
        # Imported now: a missing or unusable tool or agent stops the run before anything starts.
        if self.tool_paths:
            load_tools(self.tool_paths)
        if self.agent_function_path:
            load_agent(self.agent_function_path)

    def _check_filter_flags(self) -> None:
        # Over-sampling only acts on groups a filter rejects; without a filter it would be a
        # silent no-op (architecture.md: "Design rules"). --partial-rollout is checked with
        # --fully-async, where it has a second use (`miles.config.cross_checks`).
        if self.dynamic_sampling_filter_path is not None:
            check_filter_path(self.dynamic_sampling_filter_path)
        elif self.over_sampling_batch_size is not None:
            raise ValueError(
                f"--over-sampling-batch-size ({self.over_sampling_batch_size}) only takes effect "
                "with --dynamic-sampling-filter-path; set a filter (e.g. nonzero_std) or drop it"
            )
        if (
            self.over_sampling_batch_size is not None
            and self.over_sampling_batch_size < self.rollout_batch_size
        ):
            raise ValueError(
                f"--over-sampling-batch-size ({self.over_sampling_batch_size}) must be >= "
                f"--rollout-batch-size ({self.rollout_batch_size}); raise it or leave it unset"
            )

    @property
    def prompts_per_round(self) -> int:
        """Prompts submitted per round when a filter is set."""
        return self.over_sampling_batch_size or self.rollout_batch_size

    def sampling_seed(self, sample_index: int | None, response_length: int) -> int:
        """A request's seed: fixed by the run's seed, the sample and how far it got, so a
        resumed or repeated request draws the same tokens (on the same batch composition)."""
        key = (self.rollout_seed * 1_000_003 + (sample_index or 0)) * 1_009 + response_length
        return key % (2**31 - 1)

    def sampling_params(self) -> dict[str, Any]:
        """SGLang sampling_params for a fresh sample (max_new_tokens is the full budget)."""
        params: dict[str, Any] = {
            "temperature": self.rollout_temperature,
            "top_p": self.rollout_top_p,
            "top_k": self.rollout_top_k,
            "max_new_tokens": self.rollout_max_response_len,
            # Keep a matched stop string in the text: the reward reads the text, training the
            # tokens, and both should describe the same response.
            "no_stop_trim": True,
        }
        if self.rollout_stop:
            params["stop"] = list(self.rollout_stop)
        if self.rollout_stop_token_ids:
            params["stop_token_ids"] = list(self.rollout_stop_token_ids)
        return params
