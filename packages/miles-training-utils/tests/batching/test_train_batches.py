"""Train data: samples to columns, data-parallel shards, micro-batch iteration and packed batches."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.training_utils.batching.packing import unpack_per_token
from miles.backends.training_utils.batching.rollout_data import (
    batch_size,
    samples_to_rollout_batch,
    select_rows,
    split_rollout_batch_by_dp,
)
from miles.backends.training_utils.batching.sample import Sample
from miles.backends.training_utils.batching.train_batches import (
    DataIterator,
    dp_partitions,
    get_batch,
    get_data_iterator,
    get_rollout_data,
    token_columns,
    token_rows,
)


def _sample(index, prompt_len=3, response_len=2, **overrides):
    fields = dict(
        index=index,
        group_index=index // 2,
        tokens=[100 + index] * prompt_len + [200 + index] * response_len,
        response_length=response_len,
        reward=float(index),
        rollout_log_probs=[-0.1 * (index + 1)] * response_len,
        weight_version=3,
    )
    fields.update(overrides)
    return Sample(**fields)


def _batch(lengths):
    """A rollout batch whose sample i has a 1-token prompt and lengths[i] - 1 response tokens."""
    samples = [_sample(i, prompt_len=1, response_len=n - 1) for i, n in enumerate(lengths)]
    return samples_to_rollout_batch(samples, [0.5] * len(samples))


# -- samples_to_rollout_batch and row selection -------------------------------------------------


def test_samples_become_columns_with_one_row_per_sample():
    samples = [_sample(0, loss_mask=[0, 1]), _sample(1, response_len=1, raw_reward=7.0)]
    batch = samples_to_rollout_batch(samples, [0.25, -0.25])
    assert batch["tokens"] == [[100, 100, 100, 200, 200], [101, 101, 101, 201]]
    assert batch["response_lengths"] == [2, 1]
    assert batch["total_lengths"] == [5, 4]
    assert batch["loss_mask"] == [[0, 1], [1]]
    assert batch["rewards"] == [0.25, -0.25]
    assert batch["raw_reward"] == [0.0, 7.0]  # raw_reward when set, else the reward
    assert batch["rollout_log_probs"] == [[-0.1, -0.1], [-0.2]]
    assert batch["sample_indices"] == [0, 1]
    assert batch["weight_versions"] == [3, 3]
    assert batch_size(batch) == 2


def test_rollout_log_probs_column_is_absent_when_no_sample_has_them():
    batch = samples_to_rollout_batch([_sample(0, rollout_log_probs=None)], [1.0])
    assert "rollout_log_probs" not in batch


def test_the_teachers_top_tokens_become_k_wide_token_rows():
    top = {"teacher_top_ids": [[4, 5, 6], [7, 8, 9]], "teacher_top_log_probs": [[-1.0] * 3] * 2}
    samples = [_sample(0, **top), _sample(1, response_len=1, teacher_top_ids=[[1, 2, 3]],
                                         teacher_top_log_probs=[[-0.5, -1.5, -2.5]])]  # fmt: skip
    batch = samples_to_rollout_batch(samples, [0.0, 0.0])
    assert batch["teacher_top_ids"] == [[[4, 5, 6], [7, 8, 9]], [[1, 2, 3]]]
    batch["teacher_top_ids"][0][0][0] = 99  # the batch holds copies, row by row
    assert samples[0].teacher_top_ids[0][0] == 4
    rows = token_rows(batch, "teacher_top_log_probs", torch.float32)  # (sum R, K)
    assert rows.shape == (3, 3) and rows[2].tolist() == [-0.5, -1.5, -2.5]
    with pytest.raises(ValueError, match=r"'teacher_top_ids' row 0 has 1 positions for 2"):
        token_rows({**batch, "teacher_top_ids": [[[1, 2, 3]], [[1, 2, 3]]]}, "teacher_top_ids",
                   torch.long)  # fmt: skip
    with pytest.raises(ValueError, match=r"rows have different K: \[2, 3\]"):
        token_rows({**batch, "teacher_top_ids": [[[1, 2], [1, 2]], [[1, 2, 3]]]},
                   "teacher_top_ids", torch.long)  # fmt: skip


def test_mixing_samples_with_and_without_rollout_log_probs_is_rejected():
    samples = [_sample(0), _sample(1, rollout_log_probs=None)]
    with pytest.raises(
        ValueError, match=r"samples \[1\] have no rollout_log_probs while others do"
    ):
        samples_to_rollout_batch(samples, [0.0, 0.0])


def test_one_normalized_reward_per_sample_is_required():
    with pytest.raises(ValueError, match=r"got 1 rewards for 2 samples"):
        samples_to_rollout_batch([_sample(0), _sample(1)], [0.0])


def test_a_sample_without_index_or_reward_is_rejected():
    unindexed = _sample(0)
    unindexed.index = None
    with pytest.raises(ValueError, match=r"samples\[0\] has no index"):
        samples_to_rollout_batch([unindexed], [0.0])
    with pytest.raises(ValueError, match=r"sample 4 has no reward"):
        samples_to_rollout_batch([_sample(4, reward=None)], [0.0])


def test_a_sample_changed_into_an_invalid_state_is_caught_when_batched():
    sample = _sample(0)
    sample.response_length = 9
    with pytest.raises(ValueError, match=r"response_length \(9\)"):
        samples_to_rollout_batch([sample], [0.0])


def test_select_rows_keeps_the_given_order_and_rejects_out_of_range_rows():
    batch = _batch([3, 4, 5])
    assert select_rows(batch, [2, 0])["total_lengths"] == [5, 3]
    with pytest.raises(IndexError, match=r"row indices \[3\] are out of range for a batch of 3"):
        select_rows(batch, [0, 3])


def test_ragged_columns_are_rejected():
    with pytest.raises(ValueError, match=r"one entry per sample, got lengths"):
        batch_size({"tokens": [[1]], "rewards": [0.0, 1.0]})


def test_split_by_dp_requires_partitions_that_cover_every_row_once():
    batch = _batch([3, 4, 5, 6])
    shards = split_rollout_batch_by_dp(batch, 2, [[0, 3], [1, 2]])
    assert [s["total_lengths"] for s in shards] == [[3, 6], [4, 5]]
    with pytest.raises(ValueError, match=r"got 1 partitions for a data-parallel size of 2"):
        split_rollout_batch_by_dp(batch, 2, [[0, 1, 2, 3]])
    with pytest.raises(
        ValueError, match=r"cover rows 0..3 exactly once each; got 4 indices \(3 distinct\)"
    ):
        split_rollout_batch_by_dp(batch, 2, [[0, 1], [1, 2]])


# -- data-parallel shards -----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data(), balance=st.booleans())
def test_rollout_data_over_all_ranks_covers_every_sample_exactly_once(data, balance):
    dp_size = data.draw(st.integers(1, 6))
    per_rank = data.draw(st.integers(0, 6))
    lengths = data.draw(
        st.lists(st.integers(2, 300), min_size=dp_size * per_rank, max_size=dp_size * per_rank)
    )
    batch = _batch(lengths)
    shards = [get_rollout_data(batch, rank, dp_size, balance=balance) for rank in range(dp_size)]
    seen = sorted(i for shard in shards for i in shard["sample_indices"])
    assert seen == list(range(len(lengths)))
    assert {batch_size(shard) for shard in shards} == {per_rank}
    for shard in shards:  # rows stay whole: every column moved together
        assert shard["total_lengths"] == [lengths[i] for i in shard["sample_indices"]]


def test_balanced_shards_even_out_tokens_that_round_robin_piles_onto_one_rank():
    lengths = [100, 2, 100, 2, 100, 2, 100, 2]
    round_robin = [sum(lengths[i] for i in p) for p in dp_partitions(lengths, 2, balance=False)]
    balanced = [sum(lengths[i] for i in p) for p in dp_partitions(lengths, 2, balance=True)]
    assert round_robin == [400, 8]
    assert balanced == [204, 204]


def test_a_rollout_not_divisible_by_the_dp_size_names_the_flags_to_fix():
    with pytest.raises(
        ValueError, match=r"has 5 samples, not divisible by the data-parallel size \(2\)"
    ):
        get_rollout_data(_batch([3] * 5), 0, 2)


def test_a_dp_rank_outside_the_group_is_rejected():
    with pytest.raises(ValueError, match=r"dp_rank \(2\) must be in \[0, 2\)"):
        get_rollout_data(_batch([3] * 4), 2, 2)


# -- micro-batch iteration ----------------------------------------------------------------------


def test_data_iterator_yields_each_micro_batch_in_order_and_restarts_on_reset():
    batch = _batch([3, 4, 5])
    it = DataIterator(batch, [[2], [0, 1]])
    assert len(it) == 2
    assert [mb["total_lengths"] for mb in it] == [[5], [3, 4]]
    with pytest.raises(StopIteration):
        next(it)
    it.reset()
    assert next(it)["total_lengths"] == [5]


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(2, 64), min_size=1, max_size=30), budget=st.integers(64, 256))
def test_dynamic_iterator_keeps_every_micro_batch_within_the_token_budget(lengths, budget):
    it = get_data_iterator(
        _batch(lengths),
        micro_batch_size=None,
        max_tokens_per_gpu=budget,
        use_dynamic_batch_size=True,
    )
    micro = list(it)
    assert all(sum(mb["total_lengths"]) <= budget for mb in micro)
    assert sorted(i for mb in micro for i in mb["sample_indices"]) == list(range(len(lengths)))


def test_dynamic_iterator_can_be_forced_to_a_count_shared_across_ranks():
    it = get_data_iterator(
        _batch([10] * 6),
        micro_batch_size=None,
        max_tokens_per_gpu=100,
        use_dynamic_batch_size=True,
        num_micro_batches=3,
    )
    assert [len(mb) for mb in it.micro_batches] == [2, 2, 2]


def test_fixed_iterator_takes_micro_batch_size_samples_at_a_time():
    it = get_data_iterator(
        _batch([3] * 5), micro_batch_size=2, max_tokens_per_gpu=None, use_dynamic_batch_size=False
    )
    assert it.micro_batches == [[0, 1], [2, 3], [4]]


def test_a_setting_the_chosen_batching_mode_would_ignore_is_an_error():
    batch = _batch([3] * 4)
    with pytest.raises(
        ValueError, match=r"--use-dynamic-batch-size packs .* micro_batch_size=None \(got 2"
    ):
        get_data_iterator(
            batch, micro_batch_size=2, max_tokens_per_gpu=64, use_dynamic_batch_size=True
        )
    with pytest.raises(ValueError, match=r"pass max_tokens_per_gpu \(got None\)"):
        get_data_iterator(
            batch, micro_batch_size=None, max_tokens_per_gpu=None, use_dynamic_batch_size=True
        )
    with pytest.raises(
        ValueError, match=r"without --use-dynamic-batch-size.* max_tokens_per_gpu=None \(got 64\)"
    ):
        get_data_iterator(
            batch, micro_batch_size=2, max_tokens_per_gpu=64, use_dynamic_batch_size=False
        )


# -- packed batches -----------------------------------------------------------------------------


def test_get_batch_concatenates_per_token_columns_in_unpack_order_and_stacks_scalars():
    samples = [_sample(0, loss_mask=[1, 0]), _sample(1, prompt_len=2, response_len=3)]
    micro = samples_to_rollout_batch(samples, [1.0, -1.0])
    micro["advantages"] = [[0.5, 0.5], [1.5, 2.5, 3.5]]
    out = get_batch(
        micro, ["rollout_log_probs", "advantages", "rewards", "sample_indices"], pad_multiple=8
    )
    assert out["input_ids"].shape == (1, 16)
    assert out["advantages"].tolist() == [0.5, 0.5, 1.5, 2.5, 3.5]
    assert out["rewards"].dtype == torch.float32 and out["rewards"].tolist() == [1.0, -1.0]
    assert out["sample_indices"].dtype == torch.long
    assert out["response_lengths"].tolist() == [2, 3]
    # The packed loss mask, unpacked per document, is the per-token loss-mask column.
    per_doc = unpack_per_token(out["loss_mask"], out["packed"])
    assert torch.cat(per_doc).tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]
    assert token_columns(micro, ["loss_mask"])["loss_mask"].tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]


def test_get_batch_refuses_the_loss_mask_column_whose_name_its_packed_mask_has():
    with pytest.raises(ValueError, match=r"token_columns\(micro, \['loss_mask'\]\)"):
        get_batch(_batch([3]), ["loss_mask"])


def test_get_batch_accepts_per_token_tensors_added_by_training():
    micro = _batch([3, 4])
    micro["old_log_probs"] = [torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0, -5.0])]
    out = get_batch(micro, ["old_log_probs"])
    assert out["old_log_probs"].tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0]


def test_get_batch_rejects_per_token_rows_of_the_wrong_length():
    micro = _batch([3])
    micro["advantages"] = [[1.0]]
    with pytest.raises(ValueError, match=r"'advantages' row 0 has 1 values for 2 response tokens"):
        get_batch(micro, ["advantages"])


def test_get_batch_names_missing_keys_and_the_available_ones():
    with pytest.raises(KeyError, match=r"keys \['advantages'\] are not in the batch"):
        get_batch(_batch([3]), ["advantages"])
