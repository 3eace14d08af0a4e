"""The fully-async buffer against a real reference engine: the staleness bound under random
timings (a hypothesis property test), weight updates that drain or abort what is in flight, the
masking of older tokens, and a checkpoint of the buffer that loses no sample."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from miles.backends.sglang_utils.client import EngineClient
from miles.backends.training_utils.batching.sample import Sample, SampleStatus
from miles.rollout.data_source import DataSourceConfig, PromptDataset, RolloutDataSource
from miles.rollout.engine_pool import EnginePool
from miles.rollout.fully_async import (
    FullyAsyncConfig,
    FullyAsyncRollouts,
    mask_older_tokens,
    trained_version,
)
from miles.rollout.group_loop import group_runner
from miles.rollout.rollout_config import RolloutConfig
from miles.rollout.sample_generation import generate_sample
from miles.rollout.single_turn import CustomSampleRollout, SingleTurnRollout
from tests.support.rollout_context import rollout_context


@pytest.fixture(scope="module")
def prompts(tiny_checkpoint, tmp_path_factory) -> PromptDataset:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input": f"Q{i}: say hi"}) + "\n" for i in range(64)))
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    config = DataSourceConfig(prompt_data=str(path), label_key=None)
    return PromptDataset(config, tokenizer, labels_required=False, context_length=None)


async def reward_one(groups: list[list[Sample]]) -> None:
    for group in groups:
        for sample in group:
            sample.reward = 1.0


async def long_generate(pool, sample: Sample, sampling_params: dict) -> Sample:
    """The default generation, never stopped early by EOS: requests last long enough for a
    weight update to meet them in flight."""
    return await generate_sample(pool, sample, {**sampling_params, "ignore_eos": True})


async def push_new_version(url: str, checkpoint: Path) -> int:
    """A real weight update (the same weights from disk) that raises the engine's version."""
    async with EngineClient(url) as client:
        assert (await client.update_weights_from_disk(str(checkpoint)))["success"]
        return int((await client.get_model_info())["weight_version"])


def make_buffer(pool, prompts, config: FullyAsyncConfig, version: int, *, max_len: int,
                generate_fn=None) -> tuple[FullyAsyncRollouts, RolloutDataSource]:  # fmt: skip
    source = RolloutDataSource(prompts, prompts.config, n_samples_per_prompt=2)
    rollout = RolloutConfig(
        rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=max_len,
        rollout_concurrency=8,
    )  # fmt: skip
    made = SingleTurnRollout() if generate_fn is None else CustomSampleRollout(generate_fn)
    ctx = rollout_context(pool, source, reward_one, rollout)
    run_group = group_runner(ctx, made.generate_group)
    return FullyAsyncRollouts(run_group, source, pool, config, weight_version=version), source


# -- the pure parts -----------------------------------------------------------------------------


def spanned_sample(spans: list[tuple[str, int]], loss_mask: list[int] | None = None) -> Sample:
    length = sum(count for _, count in spans)
    return Sample(
        index=0, tokens=[1, 2, *range(length)], response_length=length, loss_mask=loss_mask,
        rollout_log_probs=[-1.0] * length,
        metadata={"weight_versions": [v for v, _ in spans],
                  "weight_version_tokens": [c for _, c in spans]},
    )  # fmt: skip


def test_masking_zeroes_exactly_the_tokens_of_older_weights():
    sample = spanned_sample([("3", 2), ("4", 3), ("5", 2)], loss_mask=[1, 0, 1, 1, 1, 1, 1])
    assert mask_older_tokens(sample) == 4  # the one already masked is not counted again
    assert sample.loss_mask == [0, 0, 0, 0, 0, 1, 1]
    assert trained_version(sample) == 3 and trained_version(sample, newest=True) == 5
    one_version = spanned_sample([("2", 3), ("2", 1)])
    assert mask_older_tokens(one_version) == 0 and one_version.loss_mask is None


def test_masking_refuses_tokens_no_generate_call_accounts_for():
    sample = spanned_sample([("1", 2), ("2", 2)])
    sample.metadata["weight_version_tokens"] = [2, 1]
    with pytest.raises(ValueError, match="needs every response token from a /generate answer"):
        mask_older_tokens(sample)


def test_a_sample_without_a_numeric_version_is_refused():
    sample = spanned_sample([("default", 2)])
    with pytest.raises(ValueError, match="numeric versions"):
        trained_version(sample)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_weight_staleness": -1}, r"--max-weight-staleness \(-1\) must be >= 0"),
        ({"unused_samples_handler": "reuse"}, "is not drop or keep"),
        ({"mask_offpolicy": True}, "without --partial-rollout"),
    ],
)
def test_config_errors_name_the_flag(fields, message):
    with pytest.raises(ValueError, match=message):
        FullyAsyncConfig(**{"max_weight_staleness": 1, "buffer_groups": 4, **fields})


# -- against the engine -------------------------------------------------------------------------


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    staleness=st.integers(0, 2),
    partial=st.booleans(),
    handler=st.sampled_from(["drop", "keep"]),
    steps=st.lists(
        st.tuples(st.floats(0.0, 0.08), st.booleans()),  # (train time, update after it?)
        min_size=2, max_size=5,
    ),
    max_len=st.integers(2, 24),
)  # fmt: skip
def test_no_trained_sample_is_older_than_the_staleness_bound(
    engine_url, tiny_checkpoint, prompts, staleness, partial, handler, steps, max_len
):
    """Random train times and update points: every sample a step takes was generated by
    weights at most `staleness` versions older than the engine's at that step."""
    config = FullyAsyncConfig(
        max_weight_staleness=staleness, buffer_groups=4, unused_samples_handler=handler,
        partial_rollout=partial, mask_offpolicy=partial,
    )  # fmt: skip

    async def run():
        async with EnginePool([engine_url]) as pool:
            version = engine_version_now = await current_version(engine_url)
            buffer, _ = make_buffer(pool, prompts, config, version, max_len=max_len)
            try:
                for train_s, update in steps:
                    groups, metrics = await buffer.take(2)
                    for sample in (s for group in groups for s in group):
                        made_by = trained_version(sample, newest=partial)
                        assert made_by is not None and made_by <= engine_version_now
                        assert engine_version_now - made_by <= staleness
                    assert metrics["async/staleness_max"] <= staleness
                    await asyncio.sleep(train_s)  # the trainer's step
                    if update:
                        await buffer.pause_for_update()
                        engine_version_now = await push_new_version(engine_url, tiny_checkpoint)
                        await buffer.resume_after_update(engine_version_now)
            finally:
                await buffer.stop()
                await pool.continue_generation()

    asyncio.run(run())


async def current_version(url: str) -> int:
    async with EngineClient(url) as client:
        return int((await client.get_model_info())["weight_version"])


async def until_engine(url: str, ready: Callable[[dict], bool], what: str,
                       timeout_s: float = 60.0) -> None:  # fmt: skip
    """Poll the engine's scheduler state until `ready(state)`: tests wait for what the engine
    is doing, never a fixed sleep (a fast engine finishes a short request within any sleep long
    enough for a slow machine to start it)."""
    deadline = time.monotonic() + timeout_s
    async with EngineClient(url) as client:
        while time.monotonic() < deadline:
            if ready((await client.get_server_info())["internal_states"][0]):
                return
            await asyncio.sleep(0.005)
    raise TimeoutError(f"the engine at {url} was not {what} within {timeout_s} s")


async def until_all_decoding(url: str, *, requests: int) -> None:
    """Until `requests` requests run and the engine has decoded two steps with all of them."""
    steps_when_all_ran: list[int] = []

    def decoded_two_steps(state: dict) -> bool:
        if state["num_running"] < requests:
            steps_when_all_ran.clear()
            return False
        steps_when_all_ran.append(state["decode_steps"])
        return state["decode_steps"] >= steps_when_all_ran[0] + 2

    await until_engine(url, decoded_two_steps, f"decoding {requests} requests")


def test_an_update_with_partial_rollout_masks_exactly_the_older_tokens(
    engine_url, tiny_checkpoint, prompts
):
    """Requests in flight at the update are aborted, continue on the new weights, and the
    tokens the old weights made get loss mask 0; tokens and log-probs made before are kept."""
    config = FullyAsyncConfig(
        max_weight_staleness=1, buffer_groups=2, partial_rollout=True, mask_offpolicy=True
    )

    async def run():
        async with EnginePool([engine_url]) as pool:
            old = await current_version(engine_url)
            buffer, _ = make_buffer(
                pool, prompts, config, old, max_len=400, generate_fn=long_generate
            )
            # Requests left by an earlier test would pass for this test's own.
            await until_engine(
                engine_url, lambda state: state["num_running"] + state["num_waiting"] == 0, "idle"
            )
            buffer.start()
            await until_all_decoding(engine_url, requests=4)
            # Freeze the engine in place (SGLang's "in_place" pause) so that no request can finish
            # before the update's abort meets it, however fast the engine decodes.
            await pool.pause_generation(mode="in_place")
            await buffer.pause_for_update()
            assert buffer.counts["aborted_groups"] == 2
            new = await push_new_version(engine_url, tiny_checkpoint)
            await buffer.resume_after_update(new)
            try:
                groups, metrics = await buffer.take(2)
            finally:
                await buffer.stop()
            return old, new, groups, metrics

    old, new, groups, metrics = asyncio.run(run())
    masked = 0
    for sample in (s for group in groups for s in group):
        assert sample.status == SampleStatus.TRUNCATED and sample.response_length == 400
        versions = [int(v) for v in sample.metadata["weight_versions"]]
        counts = sample.metadata["weight_version_tokens"]
        assert versions[-1] == new and set(versions) <= {old, new}
        assert sum(counts) == 400
        older = sum(c for v, c in zip(versions, counts, strict=True) if v == old)
        assert sample.loss_mask == [0] * older + [1] * (400 - older)
        masked += older
    assert masked > 0, "no request was in flight at the update"
    assert metrics["async/masked_offpolicy_tokens"] == masked
    assert metrics["async/continued_groups"] == 2


def test_an_update_without_partial_rollout_lets_requests_finish_on_the_old_weights(
    engine_url, tiny_checkpoint, prompts
):
    config = FullyAsyncConfig(max_weight_staleness=1, buffer_groups=2)

    async def run():
        async with EnginePool([engine_url]) as pool:
            old = await current_version(engine_url)
            buffer, _ = make_buffer(pool, prompts, config, old, max_len=64,
                                    generate_fn=long_generate)  # fmt: skip
            buffer.start()
            await asyncio.sleep(0.2)
            await buffer.pause_for_update()
            new = await push_new_version(engine_url, tiny_checkpoint)
            await buffer.resume_after_update(new)
            try:
                groups, metrics = await buffer.take(2)
            finally:
                await buffer.stop()
            return old, groups, metrics

    old, groups, metrics = asyncio.run(run())
    for sample in (s for group in groups for s in group):
        assert sample.metadata["weight_versions"] == [str(old)]  # one version, whole
        assert sample.response_length == 64 and sample.loss_mask == [1] * 64
    assert metrics["async/aborted_groups"] == 0 and metrics["async/staleness_1_ratio"] == 1.0


def test_stale_groups_are_dropped_or_their_prompts_generated_again(
    engine_url, tiny_checkpoint, prompts
):
    """Staleness 0: after an update every ready group is too old. `drop` counts them gone;
    `keep` sends their prompts back, and the next take trains on them, generated anew."""

    async def run(handler: str):
        config = FullyAsyncConfig(
            max_weight_staleness=0, buffer_groups=2, unused_samples_handler=handler
        )
        async with EnginePool([engine_url]) as pool:
            buffer, _ = make_buffer(pool, prompts, config, await current_version(engine_url),
                                    max_len=4)  # fmt: skip
            try:
                await buffer.take(2)
                stale = {group[0].group_index for group in await buffer.until_ready(2)}
                await buffer.pause_for_update()
                new = await push_new_version(engine_url, tiny_checkpoint)
                await buffer.resume_after_update(new)
                groups, metrics = await buffer.take(2)
            finally:
                await buffer.stop()
        return stale, groups, metrics, new

    stale, groups, metrics, _ = asyncio.run(run("drop"))
    assert metrics["async/dropped_groups"] == 2
    assert not stale & {group[0].group_index for group in groups}
    stale, groups, metrics, new = asyncio.run(run("keep"))
    assert metrics["async/requeued_groups"] == 2
    assert {group[0].group_index for group in groups} == stale
    assert all(s.weight_version == new for group in groups for s in group)


def test_a_checkpointed_buffer_resumes_with_every_sample(engine_url, prompts):
    """state_dict mid-generation: the ready groups come back as they were and are taken first,
    the prompts that were in flight are generated again, and no prompt is skipped or served
    twice."""
    config = FullyAsyncConfig(max_weight_staleness=1, buffer_groups=4)

    async def run():
        async with EnginePool([engine_url]) as pool:
            version = await current_version(engine_url)
            buffer, source = make_buffer(
                pool, prompts, config, version, max_len=48, generate_fn=long_generate
            )
            before, _ = await buffer.take(2)
            await buffer.until_ready(1)
            state = json.loads(json.dumps(buffer.state_dict()))  # as the checkpoint holds it
            source_state = source.state_dict()
            await buffer.stop()
            resumed, resumed_source = make_buffer(pool, prompts, config, version, max_len=48)
            resumed_source.load_state_dict(source_state)
            resumed.load_state_dict(state)
            pending = {group[0]["group_index"] for group in state["pending"]}
            after = []
            try:
                after += (await resumed.take(len(state["ready"])))[0]
                while pending - {group[0].group_index for group in after}:
                    after += (await resumed.take(1))[0]
            finally:
                await resumed.stop()
        return state, before, after

    state, before, after = asyncio.run(run())
    ready = [r["group"][0]["group_index"] for r in state["ready"]]
    assert [group[0].group_index for group in after[: len(ready)]] == ready
    saved = {s["index"]: s for r in state["ready"] for s in r["group"]}
    for sample in (s for group in after[: len(ready)] for s in group):
        assert sample.tokens == saved[sample.index]["tokens"]
        assert sample.rollout_log_probs == saved[sample.index]["rollout_log_probs"]
    served = [group[0].group_index for group in [*before, *after]]
    assert len(served) == len(set(served))  # none twice
    assert set(served) == set(range(max(served) + 1))  # none skipped
