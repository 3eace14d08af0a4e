"""The built-in rollout (`SingleTurnRollout` in the group loop) against a real reference engine: batch shapes, finish statuses, the
concurrency bound, dynamic filtering with over-sampling, partial rollouts that resume, custom
generate functions, and the configuration errors."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest

from miles.backends.sglang_utils.client import EngineClient, EngineError
from miles.backends.training_utils.batching.sample import Sample, SampleStatus
from miles.backends.training_utils.infra.import_path import ImportPathError
from miles.rollout.context import RolloutOutput
from miles.rollout.engine_pool import EnginePool
from miles.rollout.loader import load_rollout
from miles.rollout.rollout_config import RolloutConfig
from miles.rollout.train_data import rollout_metrics
from tests.support.rollout_context import rollout_context

EOS = 256  # the tiny checkpoint's <|endoftext|>
VOCAB = 259
UNREACHABLE = "http://127.0.0.1:9"  # for rollouts that never reach an engine


@pytest.fixture(autouse=True)
def custom_functions_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


class ListDataSource:
    """RolloutDataSource's interface over a few prompts (cycled), with its pushed-back buffer.

    `flat` and `slow` are sets of group indices whose samples get that metadata flag.
    """

    def __init__(self, n: int, *, flat: set[int] = frozenset(), slow: set[int] = frozenset()):
        self.n, self.flat, self.slow = n, flat, slow
        self.buffer: deque[list[Sample]] = deque()
        self.next_group = self.next_index = 0
        self.served = 0

    def get_samples(self, num_prompts: int) -> list[list[Sample]]:
        groups = []
        while self.buffer and len(groups) < num_prompts:
            groups.append(self.buffer.popleft())
        while len(groups) < num_prompts:
            groups.append(self._new_group())
        self.served += len(groups)
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self.buffer.extend(groups)

    def _new_group(self) -> list[Sample]:
        g = self.next_group
        self.next_group += 1
        prompt = f"Q{g}: say hi"
        group = []
        for _ in range(self.n):
            metadata = {"flat": g in self.flat, "slow": g in self.slow}
            sample = Sample(
                index=self.next_index,
                group_index=g,
                prompt=prompt,
                tokens=list(prompt.encode()),
                label="hi",
                metadata=metadata,
            )
            group.append(sample)
            self.next_index += 1
        return group


async def reward_by_position(groups: list[list[Sample]]) -> None:
    """Rewards 0, 1, 0, 1, ... within a group; all 0 in groups marked `flat`."""
    for group in groups:
        for position, sample in enumerate(group):
            sample.reward = 0.0 if sample.metadata["flat"] else float(position % 2)


def rollout(
    urls: list[str], source: ListDataSource, config: RolloutConfig, make_pool=EnginePool
) -> RolloutOutput:
    """One rollout of the rollout `config` names, on `make_pool(urls)`, closed afterwards."""

    async def run():
        async with make_pool(urls) as pool:
            output = await make_rollout(pool, source, config, rollout_id=0)
            assert set(pool.in_flight().values()) == {0}
            return output

    return asyncio.run(run())


async def make_rollout(
    pool: EnginePool, source: ListDataSource, config: RolloutConfig, *, rollout_id: int
) -> RolloutOutput:
    ctx = rollout_context(pool, source, reward_by_position, config)
    return await load_rollout(config).generate_rollout(ctx, rollout_id)


def check_sample(sample: Sample, max_len: int) -> None:
    """The invariants every generated sample satisfies."""
    prompt_ids = list(sample.prompt.encode())
    assert sample.tokens[: len(prompt_ids)] == prompt_ids
    assert sample.prompt_length == len(prompt_ids)
    assert 0 < sample.response_length <= max_len
    assert len(sample.rollout_log_probs) == sample.response_length
    assert all(lp <= 0 for lp in sample.rollout_log_probs)
    assert sample.loss_mask == [1] * sample.response_length
    assert isinstance(sample.weight_version, int)
    assert sample.metadata["weight_versions"] == [str(sample.weight_version)]
    if sample.status == SampleStatus.TRUNCATED:
        assert sample.response_length == max_len
    else:
        assert sample.status == SampleStatus.COMPLETED


def test_rollout_returns_batch_size_groups_of_n_scored_samples(engine_url):
    source = ListDataSource(n=2)
    config = RolloutConfig(rollout_batch_size=3, n_samples_per_prompt=2, rollout_max_response_len=8)
    output = rollout([engine_url], source, config)
    assert [[s.group_index for s in group] for group in output.groups] == [[0, 0], [1, 1], [2, 2]]
    for group in output.groups:
        assert [s.reward for s in group] == [0.0, 1.0]
        for sample in group:
            check_sample(sample, max_len=8)
    assert source.served == 3 and not source.buffer
    metrics = output.metrics
    assert metrics["rollout/submitted_groups"] == 3
    assert metrics["rollout/filtered_groups"] == metrics["rollout/aborted_groups"] == 0
    assert (metrics["rollout/reward_min"], metrics["rollout/reward_max"]) == (0.0, 1.0)
    assert metrics["rollout/generate_time_s"] > 0 and metrics["rollout/samples_per_s"] > 0


def test_status_is_truncated_at_the_length_limit_and_completed_on_a_stop_token(engine_url):
    config = RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=2, rollout_max_response_len=4)
    output = rollout([engine_url], ListDataSource(n=2), config)
    samples = [s for group in output.groups for s in group]
    truncated = [s for s in samples if s.status == SampleStatus.TRUNCATED]
    assert truncated, "8 random 4-token answers all ended in EOS"
    assert all(s.response_length == 4 for s in truncated)
    assert all(s.response_tokens[-1] == EOS for s in samples if s.status == SampleStatus.COMPLETED)
    assert rollout_metrics(output.groups)["rollout/truncated_ratio"] == len(truncated) / len(
        samples
    )

    every_token = RolloutConfig(
        rollout_batch_size=2, rollout_max_response_len=4, rollout_stop_token_ids=list(range(VOCAB))
    )
    output = rollout([engine_url], ListDataSource(n=1), every_token)
    for [sample] in output.groups:
        assert (sample.status, sample.response_length) == (SampleStatus.COMPLETED, 1)
    assert rollout_metrics(output.groups)["rollout/truncated_ratio"] == 0


class CountingPool(EnginePool):
    """Records the most /generate requests it had in flight at once, and each sample's finish
    reason (a fresh group goes out as one batched request of its samples)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.active = self.most_active = 0
        self.finish_reasons: list[str] = []

    async def generate(self, payload):
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            response = await super().generate(payload)
        finally:
            self.active -= 1
        for answer in response if isinstance(response, list) else [response]:
            self.finish_reasons.append(answer["meta_info"]["finish_reason"]["type"])
        return response


def counting_pools() -> tuple[list[CountingPool], Callable[[list[str]], CountingPool]]:
    """A CountingPool factory for `rollout`, and the list of the pools it made."""
    pools: list[CountingPool] = []

    def make(urls):
        pools.append(CountingPool(urls))
        return pools[-1]

    return pools, make


def test_requests_in_flight_never_exceed_the_rollout_concurrency(engine_url):
    config = RolloutConfig(
        rollout_batch_size=4, n_samples_per_prompt=2, rollout_max_response_len=8,
        rollout_concurrency=3,
    )  # fmt: skip
    pools, make_pool = counting_pools()
    output = rollout([engine_url], ListDataSource(n=2), config, make_pool)
    assert len(output.groups) == 4
    assert pools[0].most_active == 3


@pytest.mark.parametrize("group_filter", ["nonzero_std", "custom_rollout_fns:keep_odd_groups"])
def test_filtered_groups_are_replaced_by_over_sampled_ones_and_leftovers_aborted(
    engine_url, group_filter
):
    # Even groups get equal rewards: nonzero_std and keep_odd_groups both drop them. Groups 4 and
    # 5 run up to 600 tokens, the others 8, so they are still generating when the batch is full.
    source = ListDataSource(n=2, flat={0, 2, 4, 6, 8}, slow={4, 5})
    config = RolloutConfig(
        rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=3,
        rollout_max_response_len=600, dynamic_sampling_filter_path=group_filter,
        custom_generate_function_path="custom_rollout_fns:paced_generate",
    )  # fmt: skip
    pools, make_pool = counting_pools()
    output = rollout([engine_url], source, config, make_pool)
    # Round 1 (groups 0-2) keeps only group 1, so round 2 (groups 3-5) is submitted.
    assert [group[0].group_index for group in output.groups] == [1, 3]
    assert all(sorted(s.reward for s in group) == [0.0, 1.0] for group in output.groups)
    assert output.metrics["rollout/rounds"] == 2
    assert output.metrics["rollout/submitted_groups"] == 6
    assert output.metrics["rollout/filtered_groups"] == 2
    assert output.metrics["rollout/aborted_groups"] == 2
    assert pools[0].finish_reasons.count("abort") == 4  # both samples of groups 4 and 5
    assert not source.buffer  # without --partial-rollout leftovers are dropped


def test_partial_rollout_pushes_aborted_groups_back_and_the_next_rollout_resumes_them(
    engine_url, tiny_checkpoint
):
    # Group 0 generates up to 600 tokens, the others 8: groups 1 and 2 fill the batch and
    # group 0 is aborted part-way.
    source = ListDataSource(n=2, slow={0})
    config = RolloutConfig(
        rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=3,
        rollout_max_response_len=600, dynamic_sampling_filter_path="nonzero_std",
        partial_rollout=True, custom_generate_function_path="custom_rollout_fns:paced_generate",
    )  # fmt: skip
    first = rollout([engine_url], source, config)
    assert [group[0].group_index for group in first.groups] == [1, 2]
    assert first.metrics["rollout/aborted_groups"] == 1
    [aborted] = source.buffer
    assert [s.group_index for s in aborted] == [0, 0]
    assert all(s.status == SampleStatus.ABORTED for s in aborted)
    for sample in aborted:
        assert sample.response_length < 600
        assert len(sample.rollout_log_probs) == sample.response_length
        assert sample.tokens[: sample.prompt_length] == list(sample.prompt.encode())
    partial = [s for s in aborted if s.response_length > 0]
    assert partial, "the slow group was aborted before it generated a token"
    before = {
        s.index: (list(s.tokens), s.response_length, list(s.rollout_log_probs)) for s in aborted
    }
    old_version = partial[0].metadata["weight_versions"][0]

    # A weight update between the rollouts, and group 0 is no longer slow.
    async def update_weights():
        async with EngineClient(engine_url) as client:
            assert (await client.update_weights_from_disk(str(tiny_checkpoint)))["success"]
            return (await client.get_model_info())["weight_version"]

    new_version = asyncio.run(update_weights())
    for sample in aborted:
        sample.metadata["slow"] = False

    resume = RolloutConfig(
        rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=2,
        rollout_max_response_len=600, dynamic_sampling_filter_path="nonzero_std",
        partial_rollout=True, custom_generate_function_path="custom_rollout_fns:paced_generate",
    )  # fmt: skip
    second = rollout([engine_url], source, resume)
    assert [group[0].group_index for group in second.groups] == [0, 3]
    assert second.metrics["rollout/resumed_samples"] == len(partial)
    for sample in second.groups[0]:
        tokens, length, log_probs = before[sample.index]
        assert sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
        assert length < sample.response_length <= length + 8
        assert sample.tokens[: len(tokens)] == tokens
        assert sample.rollout_log_probs[:length] == log_probs
        assert len(sample.rollout_log_probs) == sample.response_length
        assert sample.weight_version == int(new_version)
        expected = [old_version, new_version] if length else [new_version]
        assert sample.metadata["weight_versions"] == expected
    assert not source.buffer


def test_custom_generate_function_replaces_the_engine_call():
    config = RolloutConfig(
        rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=8,
        rollout_temperature=0.5, custom_generate_function_path="custom_rollout_fns:canned_generate",
    )  # fmt: skip
    output = rollout([UNREACHABLE], ListDataSource(n=2), config)
    for group in output.groups:
        for sample in group:
            assert sample.response == "ABC" and sample.response_tokens == [65, 66, 67]
            params = sample.metadata["sampling_params"]
            assert params["max_new_tokens"] == 8 and params["temperature"] == 0.5


def test_an_engine_error_fails_the_rollout_and_leaves_nothing_in_flight(engine_url):
    class BadPrompts(ListDataSource):
        def _new_group(self):
            group = super()._new_group()
            for sample in group:
                sample.tokens = [*sample.tokens, 10_000]  # beyond the vocabulary: HTTP 400
            return group

    async def run():
        async with EnginePool([engine_url]) as pool:
            config = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2)
            with pytest.raises(EngineError, match="vocab size"):
                await make_rollout(pool, BadPrompts(n=2), config, rollout_id=3)
            return pool.in_flight()

    assert set(asyncio.run(run()).values()) == {0}


def test_a_group_of_the_wrong_size_names_the_flag():
    config = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2)
    with pytest.raises(ValueError, match=r"group of 3 samples .* --n-samples-per-prompt is 2"):
        rollout([UNREACHABLE], ListDataSource(n=3), config)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("custom_rollout_fns:no_such_fn", r"has no attribute 'no_such_fn'"),
        ("no_such_module_xyz:fn", r"cannot import module 'no_such_module_xyz'"),
        ("custom_rollout_fns:NOT_A_FUNCTION", r"names a int, not a function"),
    ],
)
def test_a_bad_custom_generate_function_path_fails_the_rollout_naming_the_flag(path, message):
    config = RolloutConfig(rollout_batch_size=1, custom_generate_function_path=path)
    with pytest.raises(ImportPathError, match=rf"--custom-generate-function-path .*{message}"):
        rollout([UNREACHABLE], ListDataSource(n=1), config)


def test_a_filter_that_does_not_return_a_bool_is_an_error(engine_url):
    config = RolloutConfig(
        rollout_batch_size=1, rollout_max_response_len=2,
        dynamic_sampling_filter_path="custom_rollout_fns:says_maybe",
    )  # fmt: skip
    with pytest.raises(TypeError, match=r"returned 'maybe' \(str\); it must return True"):
        rollout([engine_url], ListDataSource(n=1), config)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rollout_batch_size": 0}, r"--rollout-batch-size \(0\) must be at least 1"),
        ({"n_samples_per_prompt": 0}, r"--n-samples-per-prompt \(0\) must be at least 1"),
        ({"rollout_concurrency": 0}, r"--rollout-concurrency \(0\) must be at least 1"),
        ({"rollout_top_p": 0.0}, r"--rollout-top-p \(0.0\) must be in \(0, 1\]"),
        ({"rollout_top_k": 0}, r"--rollout-top-k \(0\) must be -1"),
        ({"rollout_temperature": -1.0}, r"--rollout-temperature \(-1.0\) must be >= 0"),
        (
            {"over_sampling_batch_size": 8},
            r"--over-sampling-batch-size \(8\) only takes effect with --dynamic-sampling-filter",
        ),
        (
            {"over_sampling_batch_size": 2, "dynamic_sampling_filter_path": "nonzero_std"},
            r"--over-sampling-batch-size \(2\) must be >= --rollout-batch-size \(4\)",
        ),
        (
            {"dynamic_sampling_filter_path": "nonzero"},
            r"--dynamic-sampling-filter-path 'nonzero' is neither a built-in filter",
        ),
        (
            {"custom_generate_function_path": "mod:"},
            r"--custom-generate-function-path 'mod:' is not an import path",
        ),
    ],
)
def test_config_errors_name_the_flag_and_the_value(fields, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**{"rollout_batch_size": 4, **fields})


def test_the_built_in_rollout_is_the_default_of_the_rollout_function_flag():
    from miles.rollout.single_turn import CustomSampleRollout, SingleTurnRollout

    assert type(load_rollout(RolloutConfig(rollout_batch_size=1))) is SingleTurnRollout
    custom = RolloutConfig(
        rollout_batch_size=1, custom_generate_function_path="custom_rollout_fns:canned_generate"
    )
    assert type(load_rollout(custom)) is CustomSampleRollout


def test_a_rollout_sends_the_groups_of_a_lost_engine_again_whole(engine_url, second_engine_url):
    config = RolloutConfig(
        rollout_batch_size=6, n_samples_per_prompt=2, rollout_max_response_len=24
    )

    async def run():
        async with EnginePool([engine_url, second_engine_url], fault_tolerant=True) as pool:

            async def lose_the_first_engine_once_it_serves():
                while pool.in_flight()[engine_url] == 0:
                    await asyncio.sleep(0)
                pool.mark_lost(engine_url, "killed by the test")

            killer = asyncio.create_task(lose_the_first_engine_once_it_serves())
            output = await make_rollout(pool, ListDataSource(n=2), config, rollout_id=0)
            await killer
            await pool.abort_all()
            return output, pool.serving()

    output, serving = asyncio.run(run())
    assert serving == [second_engine_url]
    assert output.metrics["rollout/reissued_groups"] >= 1
    assert [[s.group_index for s in g] for g in output.groups] == [[i, i] for i in range(6)]
    for group in output.groups:
        assert [s.reward for s in group] == [0.0, 1.0]
        for sample in group:
            check_sample(sample, max_len=24)  # one response each: nothing of the lost attempt
