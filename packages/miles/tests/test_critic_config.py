"""PPO's critic settings in the run configuration: what reaches the train step and the placement
(a critic on ranks of its own gets bundles of its own), and what is refused before start-up with
the flag, the value and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.config import load_config
from miles.ray.placement import plan_for_config
from miles.train_backend.run_spec import TrainRunSpec

BASE = ["--prompt-data", "train.jsonl", "--rollout-batch-size", "4", "--train-backend", "fsdp"]
PPO = ["--advantage-estimator", "ppo"]


def checkpoint(path: Path, vocab_size: int = 259) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    return str(path)


@pytest.fixture
def policy(tmp_path) -> str:
    return checkpoint(tmp_path / "policy")


def load(policy: str, *flags: str):
    return load_config(["--hf-checkpoint", policy, *BASE, *flags])


def test_by_default_the_critic_shares_the_policys_ranks_and_saves_beside_it(policy, tmp_path):
    config = load(policy, *PPO, "--save", str(tmp_path / "ckpt"), "--rollout-num-gpus", "1")
    assert not config.critic.on_own_ranks
    assert config.critic.critic_save == str(tmp_path / "ckpt" / "critic")
    assert config.critic.critic_load == config.critic.critic_save
    assert TrainRunSpec.from_config(config, num_rollout=1).critic is config.critic
    plan = plan_for_config(config, use_gpus=False)
    assert plan.critic_bundles == [] and len(plan.bundles) == 2


def test_a_critic_on_ranks_of_its_own_gets_bundles_after_the_engines(policy):
    config = load(policy, *PPO, "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
                  "--critic-num-gpus-per-node", "2")  # fmt: skip
    assert config.critic.on_own_ranks
    assert config.critic.ranks(1, 2) == (1, 2)  # --critic-num-nodes: the policy's
    plan = plan_for_config(config, use_gpus=True)
    assert plan.actor_bundles == [0, 1] and plan.engine_bundles == [[2]]
    assert plan.critic_bundles == [3, 4] and plan.total_resources()["GPU"] == 5.0
    colocated = load(policy, *PPO, "--colocate", "--critic-num-nodes", "1")
    plan = plan_for_config(colocated, use_gpus=True)
    assert plan.actor_bundles == [0] and plan.engine_bundles == [[0]]
    assert plan.critic_bundles == [1]  # never shared with the engines


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--critic-lr", "1e-3"], r"--critic-lr configure the critic, but --advantage-estimator "
                                  r"grpo reads no values"),
        ([*PPO, "--critic-num-gpus-per-node", "2", "--rollout-num-gpus", "1"],
         r"--critic-num-nodes 1 x --critic-num-gpus-per-node 2 = 2 critic ranks, but the policy "
         r"has 1 .*needs as many ranks"),
        ([*PPO, "--critic-num-nodes", "0", "--rollout-num-gpus", "1"],
         r"--critic-num-nodes must be a positive integer, got 0"),
        ([*PPO, "--num-critic-only-steps", "-1", "--rollout-num-gpus", "1"],
         r"--num-critic-only-steps must be >= 0, got -1"),
    ],
)  # fmt: skip
def test_bad_critic_settings_are_refused_before_start_up(policy, flags, message):
    with pytest.raises(ValueError, match=message):
        load(policy, *flags)


def test_a_critic_checkpoint_with_another_vocabulary_is_refused(policy, tmp_path):
    other = checkpoint(tmp_path / "other", vocab_size=32000)
    with pytest.raises(ValueError, match=r"vocabulary of 32000 tokens, the policy .* 259"):
        load(policy, *PPO, "--rollout-num-gpus", "1", "--critic-hf-checkpoint", other)
