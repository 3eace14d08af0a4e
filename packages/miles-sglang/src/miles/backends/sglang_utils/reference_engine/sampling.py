"""SGLang's sampling parameters, validated, and the sampler that applies them to a batch.

Log-probs are those of `softmax(logits / temperature)` (temperature 1 when greedy), the same
distribution the trainer's `get_log_probs_and_entropy` scores, so both sides agree token by token.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError
from miles.backends.sglang_utils.reference_engine.request_models import (
    SamplingParamsBody,
    validate_body,
)

# Below this temperature SGLang samples greedily.
GREEDY_TEMPERATURE = 1e-5

# SGLang sampling fields the reference engine accepts only at these defaults.
UNSUPPORTED_AT_DEFAULT: dict[str, object] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "stop_regex": None,
    "custom_params": None,
}
# Fields with no effect on what is sampled here (output formatting, scheduling hints).
ACCEPTED_AND_IGNORED = {
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "stream_interval",
}
# Newer SGLang releases name the per-request seed `sampling_seed`.
ALIASES = {"sampling_seed": "seed"}


@dataclass(kw_only=True)
class SamplingParams:
    """The sampling part of a /generate request, with SGLang's names and defaults."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.max_new_tokens >= 0, "max_new_tokens", "be >= 0"),
            (self.temperature >= 0, "temperature", "be >= 0 (0 is greedy)"),
            (0 < self.top_p <= 1, "top_p", "be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k", "be -1 (off) or >= 1"),
            (0 <= self.min_p <= 1, "min_p", "be in [0, 1]"),
            (self.n >= 1, "n", "be >= 1"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise InvalidRequestError(
                    f"sampling_params.{name}={getattr(self, name)!r} is out of range: it must {rule}"
                )

    @property
    def filters(self) -> bool:
        """Whether top-k, top-p or min-p restrict the draw (`_filter_logits` applies them)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @classmethod
    def from_json(cls, raw: Any, param: str = "sampling_params") -> SamplingParams:
        """Parse SGLang's sampling_params dict: wrong types, out-of-range values and unknown or
        unsupported fields are an InvalidRequestError naming the field (`param` prefixes it)."""
        fields = _body_fields(SamplingParamsBody)
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise InvalidRequestError(
                f"{param} must be a JSON object, got {type(raw).__name__}", param=param
            )
        kwargs = {}
        for name, value in raw.items():
            canonical = ALIASES.get(name, name)
            if canonical in fields:
                kwargs[canonical] = value
            elif name in UNSUPPORTED_AT_DEFAULT:
                if value not in (UNSUPPORTED_AT_DEFAULT[name], None):
                    raise InvalidRequestError(
                        f"{param}.{name}={value!r} is not supported by the reference engine; "
                        f"leave it at {UNSUPPORTED_AT_DEFAULT[name]!r} or use an SGLang engine",
                        param=f"{param}.{name}",
                    )
            elif name not in ACCEPTED_AND_IGNORED:
                known = ", ".join(sorted(fields))
                raise InvalidRequestError(
                    f"{param} has unknown field {name!r}; known: {known}",
                    param=f"{param}.{name}",
                )
        body = validate_body(SamplingParamsBody, kwargs, prefix=param)
        values = body.model_dump()
        stop = values["stop"]
        values["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
        values["stop_token_ids"] = list(values["stop_token_ids"] or [])
        return cls(**values)


@functools.cache
def _body_fields(body: type) -> frozenset[str]:
    # pydantic's `model_fields` is a property that costs a microsecond a look-up; a rollout's
    # request looks up every field of every sample's parameters.
    return frozenset(body.model_fields)


def _filter_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """top-k, then top-p, then min-p, on one row of temperature-scaled logits."""
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it is kept).
        drop = probs.cumsum(-1) - probs > params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def sample_next_tokens(
    logits: Tensor, params: list[SamplingParams], generators: Sequence[random.Random]
) -> tuple[list[int], list[float]]:
    """One token per row of (B, V) logits, and its log-prob under the temperature-scaled
    distribution. Each row draws from its own generator, so a seeded request gives the same
    tokens whatever else shares the batch.

    The batch is scaled, normalized and sampled at once (a decode step samples for every running
    request): each row takes one uniform draw from its generator and inverts its cumulative
    distribution. Only rows with top-k, top-p or min-p are filtered one by one."""
    logits = logits.float()
    # The trainer scores with the configured temperature even when top_k=1 makes the draw
    # greedy; only temperature 0 has no distribution of its own and is scored at 1.
    temperatures = [1.0 if p.temperature < GREEDY_TEMPERATURE else p.temperature for p in params]
    scaled = logits / logits.new_tensor(temperatures)[:, None]  # (B, V)
    log_p = torch.log_softmax(scaled, dim=-1)  # (B, V)
    drawn = [row for row, p in enumerate(params) if not p.greedy]
    if len(drawn) < len(params):
        tokens = torch.argmax(logits, dim=-1)  # (B,): the greedy rows' tokens
    else:  # an RL rollout samples every row: no greedy token to look for
        tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    if drawn:
        every_row = len(drawn) == len(params)
        filtered = [i for i, row in enumerate(drawn) if params[row].filters]
        rows = torch.tensor(drawn, device=logits.device)
        if not every_row:
            candidates = scaled.index_select(0, rows)  # (D, V), a copy
        else:  # filtering writes into its rows: `scaled` stays for the log-probs
            candidates = scaled.clone() if filtered else scaled
        for i in filtered:
            candidates[i] = _filter_logits(candidates[i], params[drawn[i]])
        # float64 keeps the cumulative sum exact enough over a large vocabulary.
        cdf = torch.softmax(candidates, dim=-1).double().cumsum(-1)  # (D, V)
        # Python's generators: a draw costs a tenth of a microsecond, a torch generator's
        # several, once per row and step; and a seed means the same draw on any device.
        uniform = torch.tensor([generators[r].random() for r in drawn], dtype=torch.float64)
        uniform = uniform.to(cdf.device) * cdf[:, -1]
        # The first token whose cumulative probability exceeds the draw: a token of probability
        # 0 (filtered out) adds nothing to the sum and is never chosen.
        picks = torch.searchsorted(cdf, uniform[:, None], right=True).squeeze(1)
        picks = picks.clamp(max=logits.shape[-1] - 1)
        if every_row:
            tokens = picks
        else:
            tokens[rows] = picks
    chosen = log_p.gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), chosen.tolist()


def _scaled_log_probs(logits: Tensor, params: list[SamplingParams], rows: list[int]) -> Tensor:
    """log_softmax of rows `rows` of (B, V) logits, each at its request's temperature (1 when
    greedy): the distribution `sample_next_tokens` scores the sampled token with."""
    index = torch.tensor(rows, device=logits.device)
    temperatures = [max(params[r].temperature, 0.0) for r in rows]
    temperatures = [1.0 if t < GREEDY_TEMPERATURE else t for t in temperatures]
    scaled = logits.index_select(0, index).float() / logits.new_tensor(temperatures)[:, None]
    return torch.log_softmax(scaled, dim=-1)


def top_log_probs(
    logits: Tensor, params: list[SamplingParams], counts: list[int]
) -> list[list[tuple[float, int]]]:
    """The `counts[row]` likeliest tokens of each row of (B, V) logits, best first, as
    (log-prob, token id), under the distribution `sample_next_tokens` scores the sampled token
    with (temperature-scaled, unfiltered). Rows with a count of 0 get []."""
    wanted = [row for row, count in enumerate(counts) if count > 0]
    out: list[list[tuple[float, int]]] = [[] for _ in counts]
    if not wanted:
        return out
    k = min(max(counts[r] for r in wanted), logits.shape[-1])
    values, ids = _scaled_log_probs(logits, params, wanted).topk(k, dim=-1)  # (W, k)
    for i, row in enumerate(wanted):
        n = min(counts[row], k)
        out[row] = list(zip(values[i, :n].tolist(), ids[i, :n].tolist(), strict=True))
    return out


def token_id_log_probs(
    logits: Tensor, params: list[SamplingParams], token_ids: list[list[int] | None]
) -> list[list[float] | None]:
    """The log-probs of the tokens `token_ids[row]` (in that order) in each row of (B, V)
    logits, under the same distribution as `top_log_probs` (SGLang's `token_ids_logprob`).
    Rows with None get None."""
    out: list[list[float] | None] = [None] * len(token_ids)
    wanted = [row for row, ids in enumerate(token_ids) if ids]
    if not wanted:
        return out
    log_p = _scaled_log_probs(logits, params, wanted)
    for i, row in enumerate(wanted):
        ids = torch.tensor(token_ids[row], device=log_p.device)
        out[row] = log_p[i].index_select(0, ids).tolist()
    return out
