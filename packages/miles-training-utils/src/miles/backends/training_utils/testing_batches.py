"""Seeded random rollout batches for tests of the training backends (what a rollout would hand the
trainer, without an engine): documents of uneven prompt and response lengths."""

from __future__ import annotations

import random


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
    batch.update(loss_masks=[], rewards=[])
    for _ in range(num_samples):
        prompt, response = rng.randint(2, 7), rng.randint(2, 8)
        tokens = [rng.randrange(vocab_size) for _ in range(prompt + response)]
        batch["tokens"].append(tokens)
        batch["response_lengths"].append(response)
        batch["total_lengths"].append(len(tokens))
        batch["loss_masks"].append([0 if masked and t == 0 else 1 for t in range(response)])
        batch["rewards"].append(rng.uniform(-1, 1))
    if rollout_log_prob is not None:
        batch["rollout_log_probs"] = [[rollout_log_prob] * r for r in batch["response_lengths"]]
    return batch
