"""Every invalid or silently-ignored algorithm setting is an error naming the flag."""

import pytest

from miles.backends.training_utils.algorithms.loss_config import LossConfig


def test_defaults_are_valid_grpo_with_symmetric_clip():
    config = LossConfig()
    assert config.advantage_estimator == "grpo" and config.eps_clip_high == config.eps_clip == 0.2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"advantage_estimator": "gae"},
            r"--advantage-estimator 'gae' is not one of grpo, dr_grpo",
        ),
        ({"loss_reduction": "mean"}, r"--loss-reduction 'mean' is not one of sample_mean"),
        ({"kl_loss_type": "k4", "use_kl_loss": True, "kl_loss_coef": 0.1}, r"--kl-loss-type 'k4'"),
        (
            {"off_policy_correction": "is"},
            r"--off-policy-correction 'is' is not one of tis, icepop, mis",
        ),
        ({"eps_clip": 1.5}, r"--eps-clip \(1.5\) must be in \[0, 1\)"),
        ({"eps_clip_c": 0.9}, r"--eps-clip-c \(0.9\) must be > 1"),
        ({"entropy_coef": -0.01}, r"--entropy-coef \(-0.01\) must be >= 0"),
        (
            {"tis_clip_low": 0.5, "tis_clip_high": 0.8},
            r"--tis-clip-low \(0.5\) and --tis-clip-high \(0.8\)",
        ),
        (
            {"loss_reduction": "constant"},
            r"--loss-reduction constant needs --loss-constant-normalizer >= 1",
        ),
        (
            {"loss_constant_normalizer": 512},
            r"--loss-constant-normalizer \(512\) only applies to --loss-reduction constant",
        ),
        ({"use_kl_loss": True}, r"--use-kl-loss with --kl-loss-coef 0.0 adds nothing"),
        ({"kl_loss_coef": 0.01}, r"--kl-loss-coef 0.01 has no effect without --use-kl-loss"),
        (
            {"kl_coef": 0.05},
            r"--kl-coef 0.05 would be ignored by --advantage-estimator grpo.*use --use-kl-loss --kl-loss-coef 0.05 instead",
        ),
        (
            {"advantage_estimator": "rloo", "kl_coef": 0.05},
            r"ignored by --advantage-estimator rloo",
        ),
        ({"gamma": 0.99}, r"--gamma 0.99 is ignored by --advantage-estimator grpo"),
        (
            {"advantage_estimator": "reinforce_plus_plus", "lambd": 0.95},
            r"--lambd 0.95 is GAE's lambda and only applies to ppo",
        ),
        (
            {"advantage_estimator": "dr_grpo"},
            r"dr_grpo removes the per-sample length normalization",
        ),
        (
            {"advantage_estimator": "rloo", "grpo_std_normalization": False},
            r"--no-grpo-std-normalization only applies to grpo and gspo",
        ),
        (
            {"loss_type": "sft_loss", "off_policy_correction": "tis"},
            r"sft_loss ignores --off-policy-correction",
        ),
    ],
)
def test_invalid_setting_names_flag_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"advantage_estimator": "ppo", "kl_coef": 0.05, "gamma": 0.99, "lambd": 0.95},
        {"advantage_estimator": "reinforce_plus_plus", "kl_coef": 0.01, "gamma": 0.99},
        {"advantage_estimator": "reinforce_plus_plus_baseline", "kl_coef": 0.01},
        {
            "advantage_estimator": "dr_grpo",
            "loss_reduction": "constant",
            "loss_constant_normalizer": 1024,
        },
        {"advantage_estimator": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4},
        {"use_kl_loss": True, "kl_loss_coef": 0.001, "kl_loss_type": "k3"},
        {"off_policy_correction": "mis", "tis_clip_high": 2.0, "mis_veto_threshold": 1e-3},
        {"eps_clip_c": 3.0, "entropy_coef": 0.001, "loss_reduction": "token_mean"},
    ],
)
def test_meaningful_combinations_are_accepted(kwargs):
    LossConfig(**kwargs)


# -- the registry's custom entries -----------------------------------------------------------


@pytest.fixture
def user_module(monkeypatch, tmp_path):
    """A user's module on sys.path, as a module in the launch directory would be."""
    (tmp_path / "user_algorithms.py").write_text(
        "from miles.backends.training_utils.algorithms.registry import EstimatorSpec, LossSpec\n"
        "from miles.backends.training_utils.algorithms.loss import sft_loss\n"
        "def rule(batch, config, masks, group):\n"
        "    return masks, masks\n"
        "NLL = LossSpec(fn=sft_loss, inputs=frozenset(), on_policy=False)\n"
        "DISCOUNTED = EstimatorSpec(advantages=rule, discounting=True)\n"
        "NOT_A_FUNCTION = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_algorithms"


def test_a_custom_function_or_spec_enters_the_registry_under_its_custom_name(user_module):
    from miles.backends.training_utils.algorithms.algorithm import Algorithm

    config = LossConfig(
        loss_type="custom_loss", custom_loss_function_path=f"{user_module}:NLL",
        advantage_estimator="custom", custom_advantage_function_path=f"{user_module}:rule",
    )  # fmt: skip
    algorithm = Algorithm.from_config(config)
    assert algorithm.loss.inputs == frozenset() and not algorithm.loss.on_policy
    assert algorithm.estimator.advantages.__name__ == "rule"  # a plain function, wrapped
    assert algorithm.inputs == frozenset()  # the loss reads no advantages: nothing to compute
    # A spec declares what it reads: a discounting estimator accepts --gamma, a plain one not.
    LossConfig(advantage_estimator="custom", custom_advantage_function_path=f"{user_module}:DISCOUNTED", gamma=0.9)  # fmt: skip
    with pytest.raises(ValueError, match=r"--gamma 0.9 is ignored by --advantage-estimator custom"):
        LossConfig(advantage_estimator="custom", custom_advantage_function_path=f"{user_module}:rule", gamma=0.9)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_type": "custom_loss"}, r"--loss-type custom_loss needs --custom-loss-function-path"),
        (
            {"custom_loss_function_path": "m:f"},
            r"--custom-loss-function-path 'm:f' is only used with --loss-type custom_loss",
        ),
        (
            {"advantage_estimator": "custom"},
            r"--advantage-estimator custom needs --custom-advantage-function-path",
        ),
        (
            {"loss_type": "custom_loss", "custom_loss_function_path": "user_algorithms:nope"},
            r"--custom-loss-function-path 'user_algorithms:nope': 'user_algorithms' has no attribute",
        ),
        (
            {"loss_type": "custom_loss",
             "custom_loss_function_path": "user_algorithms:NOT_A_FUNCTION"},
            r"names a int; point it at a function or a LossSpec",
        ),
        (
            {"loss_type": "custom_loss", "custom_loss_function_path": "no_such_module_xyz:f"},
            r"cannot import module 'no_such_module_xyz'",
        ),
    ],
)  # fmt: skip
def test_custom_paths_are_checked_when_the_config_is_built(user_module, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**kwargs)
