"""The hub with custom functions: sync/async, per-group, and the failure rule; config errors."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from miles.backends.training_utils.batching.sample import Sample
from miles.rollout.rewards import RewardConfig, RewardFailureRateError, RewardHub
from miles.rollout.rewards.hub import check_failure_rate

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def custom_rewards_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def make_sample(response: str = "r", label: str | None = "ok", group: int | None = None) -> Sample:
    return Sample(
        prompt="q",
        tokens=[1, 2, 3],
        response=response,
        response_length=1,
        label=label,
        group_index=group,
    )


def score(config: RewardConfig, samples: list[Sample]):
    async def run():
        async with RewardHub(config) as hub:
            return await hub.score(samples)

    return asyncio.run(run())


def custom(fn: str, **kwargs) -> RewardConfig:
    return RewardConfig(rm_type="custom", custom_rm_path=f"custom_rewards:{fn}", **kwargs)


def test_a_raising_reward_gets_the_failure_score_and_the_rest_are_scored(caplog):
    samples = [make_sample(label="ok"), make_sample("bad", label="boom"), make_sample(label="ok")]
    with caplog.at_level(logging.WARNING, logger="miles.rollout.rewards.hub"):
        report = score(custom("flaky", reward_failure_score=-1.0), samples)
    assert report.rewards == [1.0, -1.0, 1.0]
    assert [s.reward for s in samples] == [1.0, -1.0, 1.0]
    assert [s.raw_reward for s in samples] == [1.0, -1.0, 1.0]
    assert report.failures == 1
    assert report.metrics() == {"reward/failures": 1.0, "reward/failure_rate": pytest.approx(1 / 3)}
    assert samples[1].metadata["reward_error"] == "RuntimeError: cannot score 'bad'"
    assert report.failure_messages == [
        "sample 1 (reward 'flaky'): RuntimeError: cannot score 'bad'"
    ]
    assert "reward_error" not in samples[0].metadata
    # Logged once for the batch, with the count and the first message.
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "1 of 3 samples" in warnings[0].getMessage()
    assert "cannot score 'bad'" in warnings[0].getMessage()


def test_failure_messages_keep_only_the_first_few_but_count_all():
    samples = [make_sample(f"s{i}", label="boom") for i in range(8)]
    report = score(custom("flaky"), samples)
    assert report.failures == 8
    assert report.rewards == [0.0] * 8
    assert [m.split(" (")[0] for m in report.failure_messages] == [f"sample {i}" for i in range(5)]
    assert report.metrics()["reward/failure_rate"] == 1.0


def test_rescoring_a_sample_clears_its_old_reward_error():
    sample = make_sample(label="boom")
    score(custom("flaky"), [sample])
    assert "reward_error" in sample.metadata
    sample.label = "ok"
    score(custom("flaky"), [sample])
    assert "reward_error" not in sample.metadata and sample.reward == 1.0


def test_custom_async_function_is_awaited():
    samples = [make_sample("abc"), make_sample("hello")]
    report = score(custom("async_length"), samples)
    assert report.rewards == [3.0, 5.0] and report.failures == 0


def test_dotted_custom_path_is_accepted():
    report = score(
        RewardConfig(rm_type="custom", custom_rm_path="custom_rewards.async_length"),
        [make_sample("ab")],
    )
    assert report.rewards == [2.0]


def test_dict_rewards_use_reward_key_or_reward():
    assert score(custom("as_dict"), [make_sample()]).rewards == [-1.0]
    assert score(custom("as_dict", reward_key="score"), [make_sample()]).rewards == [0.25]
    report = score(custom("as_dict", reward_key="missing"), [make_sample()])
    assert report.failures == 1 and "--reward-key" in report.failure_messages[0]


def test_non_numbers_and_non_finite_rewards_are_failures_but_bools_count():
    samples = [make_sample(label=kind) for kind in ("str", "nan", "none", "bool")]
    report = score(custom("bad_values", reward_failure_score=-5.0), samples)
    assert report.rewards == [-5.0, -5.0, -5.0, 1.0]
    assert "not a number" in samples[0].metadata["reward_error"]
    assert "not a finite number" in samples[1].metadata["reward_error"]
    assert "NoneType" in samples[2].metadata["reward_error"]


def test_a_non_finite_reward_is_refused_naming_the_sample_its_group_and_the_reward(caplog):
    samples = [make_sample(label="ok", group=0), make_sample(label="nan", group=3)]
    with caplog.at_level(logging.WARNING, logger="miles.rollout.rewards.hub"):
        report = score(custom("bad_values", reward_failure_score=-1.0), samples[1:])
    assert report.rewards == [-1.0]
    assert report.failure_messages == [
        "sample 0 of group 3 (reward 'bad_values'): ValueError: reward returned nan, not a "
        "finite number"
    ]
    assert "sample 0 of group 3 (reward 'bad_values')" in caplog.text


def test_rewards_beyond_1e6_are_kept_and_warned_about_naming_the_sample_and_the_reward(caplog):
    samples = [make_sample(label=label, group=1) for label in ("1e308", "1e200", "1")]
    with caplog.at_level(logging.WARNING, logger="miles.rollout.rewards.hub"):
        report = score(custom("magnitude"), samples)
    assert report.rewards == [1e308, 1e200, 1.0] and report.failures == 0
    assert "reward/clipped" not in report.metrics()
    warning = caplog.text
    assert "2 of 3 rewards exceed 1e+06 in magnitude" in warning and "--reward-clip" in warning
    assert "sample 0 of group 1 (reward 'magnitude'): 1e+308" in warning


def test_reward_clip_bounds_every_reward_and_counts_the_clipped(caplog):
    samples = [make_sample(label=label) for label in ("1e308", "-1e200", "1", "nan")]
    with caplog.at_level(logging.WARNING, logger="miles.rollout.rewards.hub"):
        report = score(custom("magnitude", reward_clip=5.0), samples)
    # NaN is no magnitude to clip: it stays a failure.
    assert report.rewards == [5.0, -5.0, 1.0, 0.0] and report.failures == 1
    assert report.metrics()["reward/clipped"] == 2.0
    assert "exceed" not in caplog.text


def test_a_rollout_whose_reward_fails_too_often_stops_naming_the_errors():
    samples = [make_sample(f"s{i}", label="boom" if i < 6 else "ok") for i in range(10)]
    report = score(custom("flaky"), samples)
    check_failure_rate(4, 10, [], max_rate=0.5, rollout_id=2)  # 40%: goes on
    with pytest.raises(RewardFailureRateError) as error:
        check_failure_rate(
            report.failures, len(report.rewards), report.failure_messages, max_rate=0.5,
            rollout_id=2,
        )  # fmt: skip
    message = str(error.value)
    assert "6 of 10 samples of rollout 2 failed their reward (60%" in message
    assert "--max-reward-failure-rate 0.5" in message
    assert "sample 0 (reward 'flaky'): RuntimeError: cannot score 's0'" in message
    check_failure_rate(10, 10, ["x"], max_rate=1.0, rollout_id=2)  # 1: never stops


def test_a_reward_past_the_timeout_fails_without_stalling_the_batch():
    report = score(custom("sleeps_forever", rm_timeout_s=0.2), [make_sample(), make_sample()])
    assert report.failures == 2
    assert all("timed out after 0.2 s (--rm-timeout-s)" in m for m in report.failure_messages)


def test_a_timeout_error_raised_by_the_function_keeps_its_own_message():
    report = score(custom("raises_timeout", rm_timeout_s=30), [make_sample()])
    assert report.failure_messages == [
        "sample 0 (reward 'raises_timeout'): TimeoutError: upstream judge timed out"
    ]


def test_a_slow_sync_reward_times_out_too():
    report = score(custom("sleeps_a_while", rm_timeout_s=0.2), [make_sample()])
    assert report.failures == 1 and "timed out" in report.failure_messages[0]


def test_sync_rewards_run_concurrently_in_threads():
    # Each call waits on a 4-party barrier: serial calls would break it (BrokenBarrierError).
    report = score(custom("needs_three_peers"), [make_sample() for _ in range(4)])
    assert report.failures == 0, report.failure_messages


def test_rm_concurrency_bounds_evaluations_in_flight():
    import custom_rewards

    custom_rewards.IN_FLIGHT.update(now=0, peak=0)
    report = score(custom("count_in_flight", rm_concurrency=2), [make_sample() for _ in range(6)])
    assert report.failures == 0
    assert custom_rewards.IN_FLIGHT["peak"] == 2


def test_group_rm_calls_the_function_once_per_group():
    import custom_rewards

    custom_rewards.CALLS.clear()
    groups = [[make_sample("a"), make_sample("b")], [make_sample("c"), make_sample("d")]]

    async def run():
        return await RewardHub(custom("group_mean_rank", group_rm=True)).score_groups(groups)

    report = asyncio.run(run())
    assert custom_rewards.CALLS == [["a", "b"], ["c", "d"]]
    assert report.rewards == [0.0, 0.5, 0.0, 0.5]  # flattened order


def test_group_rm_score_groups_samples_by_group_index():
    import custom_rewards

    custom_rewards.CALLS.clear()
    samples = [make_sample("a", group=0), make_sample("x", group=1), make_sample("b", group=0)]
    report = score(custom("group_mean_rank", group_rm=True), samples)
    assert sorted(custom_rewards.CALLS) == [["a", "b"], ["x"]]
    assert report.rewards == [0.0, 0.0, 0.5]


def test_group_rm_failures_fail_the_group_or_only_the_bad_values():
    groups = [[make_sample(), make_sample()]]
    report = asyncio.run(
        RewardHub(custom("group_wrong_length", group_rm=True)).score_groups(groups)
    )
    assert report.failures == 2 and "one reward per sample (2)" in report.failure_messages[0]
    report = asyncio.run(RewardHub(custom("group_mixed", group_rm=True)).score_groups(groups))
    assert report.rewards == [1.0, 0.0] and report.failures == 1


def test_empty_batch_scores_to_an_empty_report():
    report = score(RewardConfig(rm_type="exact_match"), [])
    assert report.rewards == [] and report.metrics() == {
        "reward/failures": 0.0,
        "reward/failure_rate": 0.0,
    }


# --- configuration errors ---------------------------------------------------------------


@pytest.mark.parametrize(("typo", "suggestion"), [("mth", "math"), ("exact-match", "exact_match")])
def test_unknown_rm_type_suggests_the_closest(typo, suggestion):
    with pytest.raises(ValueError, match=f"--rm-type '{typo}'.*did you mean '{suggestion}'"):
        RewardConfig(rm_type=typo)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rm_type": "custom"}, "--rm-type custom needs --custom-rm-path"),
        ({"custom_rm_path": "m:f"}, "--custom-rm-path .* only used by --rm-type custom"),
        ({"rm_type": "remote"}, "--rm-type remote needs --rm-url"),
        ({"rm_type": "f1", "rm_url": "http://x"}, "--rm-url .* only used by --rm-type remote"),
        ({"rm_type": "remote", "rm_url": "localhost:8000"}, "http:// or https://"),
        ({"group_rm": True}, "--group-rm .* only applies to --rm-type remote or custom"),
        ({"rm_type": "f1", "reward_key": "r"}, "--reward-key .* only applies"),
        ({"rm_max_retries": 5}, "--rm-max-retries .* only applies to --rm-type remote"),
        ({"rm_timeout_s": 0}, "--rm-timeout-s"),
        ({"rm_concurrency": 0}, "--rm-concurrency"),
        ({"reward_failure_score": float("nan")}, "--reward-failure-score"),
        ({"reward_clip": 0.0}, "--reward-clip .* positive finite bound"),
        ({"reward_clip": float("inf")}, "--reward-clip .* positive finite bound"),
        ({"reward_clip": 1.0, "reward_failure_score": -2.0}, "outside --reward-clip"),
        ({"max_reward_failure_rate": 1.5}, "--max-reward-failure-rate .* in \\[0, 1\\]"),
        ({"rm_type": "custom", "custom_rm_path": "no_function_named"}, "package.module:function"),
    ],
)
def test_inconsistent_flags_are_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RewardConfig(**kwargs)


def test_bad_custom_import_paths_fail_when_the_hub_is_built():
    with pytest.raises(ImportError, match=r"--custom-rm-path 'no_such_module_xyz:f'.*import"):
        RewardHub(RewardConfig(rm_type="custom", custom_rm_path="no_such_module_xyz:f"))
    with pytest.raises(ImportError, match=r"has no attribute 'flakey'.*did you mean 'flaky'"):
        RewardHub(custom("flakey"))
    with pytest.raises(ImportError, match="names a int, not a function"):
        RewardHub(custom("NOT_A_FUNCTION"))
