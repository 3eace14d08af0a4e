"""From a rollout's samples to what one train step consumes.

`sample` (`Sample`: one answer, as the rollout fills it in), `rollout_data` (`RolloutBatch`: the
columnar batch of a rollout), `balance` (partitions of near-equal token totals), `micro_batch`
(fixed or within a token budget), `packing` (a micro-batch's documents in one row for varlen
attention) and `train_batches` (this rank's shard, its micro-batches and their tensors).
"""
