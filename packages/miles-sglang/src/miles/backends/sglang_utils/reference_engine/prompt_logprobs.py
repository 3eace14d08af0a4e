"""Log-probs of a prompt's own tokens (SGLang's `input_*` log-prob fields), from prefill logits.

What SGLang 0.5.23 returns, and so what `score_prompt` computes (its scheduler.py
`handle_generate_request`, scheduler_components/logprob_result_processor.py and
layers/logprob_processor.py):
- Prompt positions `start` .. L-1 are listed (L the prompt's length). The first of them is always
  None: SGLang scores logits rows start .. L-1, each the distribution of the token after it,
  prepends None and drops the last row's entry. So entry j > 0 is
  log p(ids[start + j] | ids[:start + j]), and ids[start]'s own log-prob is never listed, even
  for start > 0. `input_top_logprobs` and `input_token_ids_logprobs` have the same None first.
- The distribution is the model's own: log_softmax of the float32 logits, whatever the
  request's temperature (the log-probs of sampled tokens use the temperature-scaled one).
- A request that generates nothing (max_new_tokens=0) gets one `output_top_logprobs` /
  `output_token_ids_logprobs` entry: the same unscaled distribution, after the whole prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Prompt positions whose float32 log-softmax is held at once: bounds a long prompt's memory.
_CHUNK_ROWS = 512


@dataclass
class PromptLogprobs:
    """What `score_prompt` found for one prompt."""

    start: int
    """The first listed prompt position (SGLang's `logprob_start_len`); the prompt's length when
    none is listed."""
    token: list[float | None]
    """`input_token_logprobs`' values, for the prompt's ids[start:]: None first."""
    top: list[list[tuple[float, int]] | None]
    """`input_top_logprobs`, (log-prob, token id) likeliest first; [] unless asked for."""
    token_ids: list[list[float] | None]
    """`input_token_ids_logprobs`' values, one per asked token id; [] unless asked for."""
    next_top: list[tuple[float, int]]
    next_token_ids: list[float]
    """The same two for the token after the prompt (a max_new_tokens=0 request's output)."""


@torch.no_grad()
def score_prompt(
    logits: Tensor, input_ids: list[int], start: int, top_k: int, token_ids: list[int] | None
) -> PromptLogprobs:
    """`logits`: the prompt's (L, V) logits, row p the distribution of the token after
    position p. `start` in [0, L]; `top_k` 0 and `token_ids` None skip those lists."""
    length = len(input_ids)
    first = min(start, length - 1)  # the last row is always scored: the next-token entries
    device = logits.device
    # The token each row predicts; the last row's is not in the prompt (0 is a placeholder).
    targets = torch.tensor([*input_ids[first + 1 :], 0], device=device)
    asked = torch.tensor(token_ids or [], dtype=torch.long, device=device)
    token: list[float] = []
    top: list[list[tuple[float, int]]] = []
    by_id: list[list[float]] = []
    for lo in range(first, length, _CHUNK_ROWS):
        hi = min(lo + _CHUNK_ROWS, length)
        log_p = torch.log_softmax(logits[lo:hi].float(), dim=-1)
        # A -inf (a masked-out token) is not JSON: SGLang clamps its output log-probs the same way.
        log_p.clamp_(min=torch.finfo(log_p.dtype).min)
        token += log_p.gather(1, targets[lo - first : hi - first, None]).squeeze(1).tolist()
        if top_k:
            values, indices = log_p.topk(min(top_k, log_p.shape[-1]), dim=-1)
            top += [
                list(zip(v, i, strict=True))
                for v, i in zip(values.tolist(), indices.tolist(), strict=True)
            ]
        if token_ids:
            by_id += log_p[:, asked].tolist()
    listed = start < length  # rows first .. L-2 predict prompt tokens, the last row does not
    return PromptLogprobs(
        start=start,
        token=[None, *token[:-1]] if listed else [],
        top=[None, *top[:-1]] if listed and top_k else [],
        token_ids=[None, *by_id[:-1]] if listed and token_ids else [],
        next_top=top[-1] if top_k else [],
        next_token_ids=by_id[-1] if token_ids else [],
    )
