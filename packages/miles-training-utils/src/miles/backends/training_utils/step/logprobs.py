"""Per-token log-probs and entropy from logits, in chunks, with a hand-written backward.

A plain `log_softmax(logits.float())` holds a float32 copy of the whole [tokens, vocab] logits and
its output (8k tokens x 152k vocab is ~5 GB each), and autograd keeps them for the backward pass.
Here both passes walk the tokens `chunk_size` rows at a time, so the extra memory is a few
[chunk, vocab] float32 buffers whatever the sequence length; only the input logits are saved.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_CHUNK_SIZE = 1024


def _chunk_log_softmax(logits: Tensor, temperature: float) -> Tensor:
    """float32 log-softmax of one (C, V) chunk of `logits / temperature`; one (C, V) temporary."""
    if temperature == 1.0:
        return torch.log_softmax(logits.float(), dim=-1)  # (C, V)
    # A copy even when `logits` is float32 already (`.float()` would return the caller's tensor,
    # and dividing it in place would change the logits the backward pass recomputes from).
    scaled = logits.to(torch.float32, copy=True)  # (C, V)
    return torch.log_softmax(scaled.div_(temperature), dim=-1)  # (C, V)


def _chunk_forward(logits: Tensor, tokens: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(token log-probs (C, K), entropy (C,)) of one chunk, holding at most two (C, V) float32
    buffers; `tokens` is (C, K)."""
    log_p = _chunk_log_softmax(logits, temperature)  # (C, V)
    token_log_p = log_p.gather(-1, tokens)  # (C, K)
    entropy = -log_p.exp().mul_(log_p).sum(-1)  # (C,)
    return token_log_p, entropy


class _ChunkedLogProbs(torch.autograd.Function):
    """Log-probs of K tokens per position (`tokens` (T, K)) and the entropy of each position."""

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, chunk_size: int):
        num_tokens = logits.shape[0]
        log_probs = torch.empty(tokens.shape, dtype=torch.float32, device=logits.device)  # (T, K)
        entropy = torch.empty(num_tokens, dtype=torch.float32, device=logits.device)  # (T,)
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            log_probs[start:end], entropy[start:end] = _chunk_forward(
                logits[start:end], tokens[start:end], temperature
            )
        ctx.save_for_backward(logits, tokens, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: Tensor | None, grad_entropy: Tensor | None):
        logits, tokens, entropy = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk_size):
            end = min(start + chunk_size, logits.shape[0])
            log_p = _chunk_log_softmax(logits[start:end], temperature)  # (C, V)
            probs = log_p.exp()  # (C, V)
            # d log p_y / d z = onehot(y) - p ; d H / d z = -p * (log p + H); both through z / T.
            grad = torch.zeros_like(probs)  # (C, V)
            if grad_log_probs is not None:
                g = grad_log_probs[start:end].float()  # (C, K)
                grad -= g.sum(-1, keepdim=True) * probs
                grad.scatter_add_(-1, tokens[start:end], g)
            if grad_entropy is not None:
                g = grad_entropy[start:end].float().unsqueeze(-1)  # (C, 1)
                grad -= g * probs * (log_p + entropy[start:end].unsqueeze(-1))
            grad_logits[start:end] = (grad / temperature).to(logits.dtype)
        return grad_logits, None, None, None


def get_log_probs_and_entropy(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, Tensor]:
    """Log-prob of each target token and the entropy of each position's distribution.

    Both come from `softmax(logits / temperature)`, the distribution the rollout engine samples
    from, so trainer and engine log-probs of the same tokens agree. `logits` is (T, V) in any
    float dtype, `tokens` (T,) the targets (the *next* tokens), or (T, K) for K tokens per
    position (the target and a teacher's top tokens, say). Returns float32 log-probs shaped as
    `tokens` and a (T,) entropy, differentiable w.r.t. `logits`.
    """
    if logits.dim() != 2 or tokens.dim() not in (1, 2) or tokens.shape[0] != logits.shape[0]:
        raise ValueError(
            f"expected logits (T, V) and tokens (T,) or (T, K), got logits "
            f"{tuple(logits.shape)} and tokens {tuple(tokens.shape)}; flatten batch and sequence "
            "dims before calling"
        )
    if temperature <= 0:
        raise ValueError(
            f"temperature must be > 0 (the engine's sampling temperature), got {temperature}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    per_position = tokens.long().view(tokens.shape[0], -1)  # (T, K)
    log_probs, entropy = _ChunkedLogProbs.apply(
        logits, per_position, float(temperature), int(chunk_size)
    )
    return log_probs.view(tokens.shape), entropy
