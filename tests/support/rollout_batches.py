"""Seeded random rollout batches for tests of the training backends (what a rollout would hand the
trainer, without an engine): documents of uneven prompt and response lengths."""

from __future__ import annotations

import random
from typing import Any


def random_rollout_batch(
    num_samples: int,
    *,
    seed: int,
    vocab_size: int = 256,
    rollout_log_prob: float | None = None,
    masked: bool = False,
) -> dict[str, list]:
    """A columnar batch of `num_samples` documents with uniform random rewards in [-1, 1].

    `rollout_log_prob` adds the engine's log-probs as that constant for every response token (for
    the step-0 check's arithmetic); None leaves them out. `masked` sets the loss mask of each
    response's first token to 0 (as for a tool's output), so loss-mask weighting shows.
    """
    rng = random.Random(seed)
    batch: dict[str, list] = {k: [] for k in ("tokens", "response_lengths", "total_lengths")}
    batch.update(loss_mask=[], rewards=[])
    for _ in range(num_samples):
        prompt, response = rng.randint(2, 7), rng.randint(2, 8)
        tokens = [rng.randrange(vocab_size) for _ in range(prompt + response)]
        batch["tokens"].append(tokens)
        batch["response_lengths"].append(response)
        batch["total_lengths"].append(len(tokens))
        batch["loss_mask"].append([0 if masked and t == 0 else 1 for t in range(response)])
        batch["rewards"].append(rng.uniform(-1, 1))
    if rollout_log_prob is not None:
        batch["rollout_log_probs"] = [[rollout_log_prob] * r for r in batch["response_lengths"]]
    return batch


def with_scored_ids(batch: dict[str, list], k: int, *, seed: int, vocab_size: int = 256) -> dict:
    """`batch` with K random token ids to score at every response position (`SCORED_TOKEN_IDS`,
    as --opd-kl-mode topk sends the teacher's top tokens)."""
    from miles.backends.training_utils.step.train_engine import SCORED_TOKEN_IDS

    rng = random.Random(seed)
    scored = [
        [[rng.randrange(vocab_size) for _ in range(k)] for _ in range(r)]
        for r in batch["response_lengths"]
    ]
    return {**batch, SCORED_TOKEN_IDS: scored}


def scored_forward(engine, micro: dict) -> dict[str, Any]:
    """What a train engine's `forward_backward` hands its loss for the one micro-batch `micro`:
    the response log-probs and the scored ids' log-probs (CPU float64), from a zero loss that
    leaves no gradient (they are zeroed after)."""

    def loss_fn(index, log_probs, entropy, scored):
        loss = (log_probs.sum() + entropy.sum() + scored.sum()) * 0.0  # backward runs through all
        return loss, {"log_probs": log_probs.detach(), "scored": scored.detach()}

    (pairs,) = engine.forward_backward([micro], loss_fn)
    engine.zero_grad()
    return {name: value.double().cpu() for name, value in pairs.items()}


def reference_scored(model, micro: dict, temperature: float) -> dict[str, Any]:
    """`scored_forward`'s two from `model` (a Hugging Face causal LM, float64 say), one document
    at a time with a plain log-softmax: what the engine must match."""
    import torch

    from miles.backends.training_utils.step.train_engine import SCORED_TOKEN_IDS

    log_probs, scored = [], []
    for tokens, r, ids in zip(
        micro["tokens"], micro["response_lengths"], micro[SCORED_TOKEN_IDS], strict=True
    ):
        start = len(tokens) - r
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens])).logits[0]  # (L, V)
        log_p = torch.log_softmax(logits[start - 1 : -1].double() / temperature, -1)  # (R, V)
        log_probs.append(log_p.gather(-1, torch.tensor(tokens[start:]).unsqueeze(-1))[:, 0])
        scored.append(log_p.gather(-1, torch.tensor(ids).view(r, -1)))
    return {"log_probs": torch.cat(log_probs), "scored": torch.cat(scored)}
