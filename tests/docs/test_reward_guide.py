"""docs/guides/adding-a-reward-function.md: its modules run as the page writes them, scored
through the real `RewardHub` (the remote server on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from miles.backends.training_utils.batching.sample import Sample
from miles.rollout.rewards import RewardConfig, RewardHub, RewardReport
from tests.docs.guide import write_modules

GUIDE = "adding-a-reward-function.md"
MODULES = ("my_rewards", "test_my_rewards", "rm_server")


@pytest.fixture
def guide_modules(tmp_path, monkeypatch):
    write_modules(GUIDE, [f"{name}.py" for name in MODULES], tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in MODULES:
        sys.modules.pop(name, None)


def score(config: RewardConfig, responses: list[str]) -> tuple[RewardReport, list[Sample]]:
    """One group of answers to a question whose label is "8", scored by the hub."""

    async def run() -> RewardReport:
        async with RewardHub(config) as hub:
            return await hub.score_groups([group])

    group = [Sample(group_index=0, index=i, label="8", response=r) for i, r in enumerate(responses)]
    return asyncio.run(run()), group


def test_the_guides_own_tests_pass(guide_modules):
    module = importlib.import_module("test_my_rewards")
    tests = [getattr(module, name) for name in dir(module) if name.startswith("test_")]
    assert len(tests) == 3
    for test in tests:
        test()


def test_a_dict_reward_without_its_key_fails_every_sample_with_the_failure_score(guide_modules):
    config = RewardConfig(
        rm_type="custom", custom_rm_path="my_rewards:judged_reward", reward_failure_score=-1.0
    )
    report, group = score(config, ["8", "9"])
    assert report.rewards == [-1.0, -1.0] and [s.reward for s in group] == [-1.0, -1.0]
    assert report.metrics() == {"reward/failures": 2.0, "reward/failure_rate": 1.0}
    assert all("set --reward-key" in s.metadata["reward_error"] for s in group)


def test_a_group_reward_without_group_rm_gets_one_sample_and_fails(guide_modules):
    config = RewardConfig(rm_type="custom", custom_rm_path="my_rewards:majority_vote_reward")
    report, group = score(config, ["7", "7", "3"])
    assert report.failures == 3 and report.rewards == [0.0, 0.0, 0.0]
    assert group[0].metadata["reward_error"].startswith("TypeError")


def test_a_misspelled_function_is_named_with_the_closest_one(guide_modules):
    config = RewardConfig(rm_type="custom", custom_rm_path="my_rewards:digit_rewards")
    with pytest.raises(ImportError, match=r"--custom-rm-path.*did you mean 'digit_reward'"):
        RewardHub(config)


@contextlib.contextmanager
def serve(app) -> Iterator[str]:
    """`app` served by uvicorn on a loopback port in a thread; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.parametrize("group_rm", [False, True], ids=["per-sample", "group-rm"])
def test_the_remote_server_scores_through_rm_type_remote(guide_modules, group_rm):
    from rm_server import app

    with serve(app) as url:
        config = RewardConfig(rm_type="remote", rm_url=f"{url}/score", group_rm=group_rm)
        report, group = score(config, ["8", " 8 ", "3"])
    assert report.failures == 0, report.failure_messages
    assert report.rewards == [1.0, 1.0, 0.0] and [s.reward for s in group] == [1.0, 1.0, 0.0]
