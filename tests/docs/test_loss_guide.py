"""docs/guides/adding-a-loss.md: its blocks run as the page writes them.

A block headed `# algorithms/loss.py` (or `advantages.py`, `registry.py`) is what the page adds
to that module: it runs in a copy of the module's namespace and is patched into the module, so
the registry resolves the guide's entries by their import paths as it would after the edit.
"""

from __future__ import annotations

import sys

import pytest
import torch

from miles.backends.training_utils.algorithms import advantages, loss, registry
from miles.backends.training_utils.algorithms.algorithm import (
    Algorithm,
    compute_advantages_and_returns,
    shape_rewards,
)
from miles.backends.training_utils.algorithms.loss import LossNormalizer
from miles.backends.training_utils.algorithms.loss_config import LossConfig
from tests.docs.guide import block, write_modules

GUIDE = "adding-a-loss.md"


def run_in(namespace: dict, source: str) -> dict:
    """Run `source` in `namespace` with postponed annotations, as every miles module has them
    (the guide's functions name `LossConfig`, which loss.py imports for type checking only)."""
    exec(compile(f"from __future__ import annotations\n{source}", GUIDE, "exec"), namespace)
    return namespace


def guide_tables() -> tuple[dict, dict]:
    """`LOSSES` and `ESTIMATORS` as the guide's registry blocks write them."""
    losses = run_in(
        dict(vars(registry)), block(GUIDE, "algorithms/registry.py", containing="LOSSES")
    )
    estimators = run_in(
        dict(vars(registry)), block(GUIDE, "algorithms/registry.py", containing="ESTIMATORS")
    )
    return losses["LOSSES"], estimators["ESTIMATORS"]


@pytest.fixture
def reinforce_loss(monkeypatch):
    """loss.py and registry.py as the guide edits them: the function added, the entry registered."""
    fn = run_in(dict(vars(loss)), block(GUIDE, "algorithms/loss.py"))["reinforce_loss"]
    monkeypatch.setattr(loss, "reinforce_loss", fn, raising=False)
    monkeypatch.setattr(registry, "LOSSES", guide_tables()[0])
    return fn


@pytest.fixture
def batch_mean_estimator(monkeypatch):
    """advantages.py and registry.py as the guide edits them."""
    shaper = run_in(dict(vars(advantages)), block(GUIDE, "algorithms/advantages.py"))
    monkeypatch.setattr(advantages, "batch_centred", shaper["batch_centred"], raising=False)
    for name, spec in guide_tables()[1].items():
        monkeypatch.setitem(registry.ESTIMATORS, name, spec)


def test_the_guide_shows_the_registry_as_it_is_plus_its_new_entries():
    losses, estimators = guide_tables()
    assert {k: v for k, v in losses.items() if k != "reinforce_loss"} == registry.LOSSES
    assert losses["reinforce_loss"].inputs == {"advantages"}
    assert set(estimators) == {"reinforce_batch_mean"}  # the block elides the built-ins
    assert "reinforce_batch_mean" not in registry.ESTIMATORS


def test_the_guides_own_test_passes_against_the_registered_loss(reinforce_loss):
    namespace = run_in(
        {"__name__": "guide_test_loss"}, block(GUIDE, "tests/algorithms/test_loss.py")
    )
    (test,) = [fn for name, fn in namespace.items() if name.startswith("test_")]
    test()


def test_the_registered_loss_is_found_by_its_name_and_reads_advantages_only(reinforce_loss):
    config = LossConfig(loss_type="reinforce_loss")
    algorithm = Algorithm.from_config(config)
    assert algorithm.loss.loss_function is reinforce_loss  # resolved by its import path
    assert algorithm.inputs == {"advantages"}  # no old-policy or reference forward
    with pytest.raises(ValueError, match="is not one of policy_loss, sft_loss, reinforce_loss"):
        LossConfig(loss_type="reinforce")


@pytest.mark.parametrize("reduction", ["sample_mean", "token_mean"])
def test_the_loss_and_its_gradient_match_a_float64_reference(reinforce_loss, reduction):
    gen = torch.Generator().manual_seed(0)
    lengths = [4, 1, 3]
    log_probs = -torch.rand(sum(lengths), generator=gen, dtype=torch.float64)
    log_probs.requires_grad_(True)
    adv = torch.randn(sum(lengths), generator=gen, dtype=torch.float64)
    mask = [1, 0, 1, 1, 1, 0, 1, 1]
    batch = {"log_probs": log_probs, "advantages": adv,
             "loss_mask": torch.tensor(mask), "response_lengths": lengths}  # fmt: skip
    config = LossConfig(loss_type="reinforce_loss", loss_reduction=reduction)
    got, _ = reinforce_loss(batch, config, LossNormalizer(num_samples=3, num_tokens=sum(mask)))

    # Plain Python: -A * log pi per trainable token, reduced as the guide's reduction says.
    per_token = [-a * lp for a, lp in zip(adv.tolist(), log_probs.tolist(), strict=True)]
    if reduction == "token_mean":
        want = sum(x * m for x, m in zip(per_token, mask, strict=True)) / sum(mask)
        want_grad = [-a * m / sum(mask) for a, m in zip(adv.tolist(), mask, strict=True)]
    else:  # each sample's mean over its trainable tokens, then the mean over the 3 samples
        want, want_grad, start = 0.0, [], 0
        for n in lengths:
            rows = range(start, start + n)
            count = max(1, sum(mask[i] for i in rows))
            want += sum(per_token[i] * mask[i] for i in rows) / count / 3
            want_grad += [-adv[i].item() * mask[i] / count / 3 for i in rows]
            start += n
    assert got.item() == pytest.approx(want, rel=1e-12)
    got.backward()
    assert log_probs.grad.tolist() == pytest.approx(want_grad, rel=1e-12, abs=1e-15)


def test_the_batch_mean_estimator_centres_rewards_on_the_rollout_mean(batch_mean_estimator):
    config = LossConfig(advantage_estimator="reinforce_batch_mean")
    raw = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    shaped = shape_rewards(torch.tensor(raw), config, group_size=2)
    assert shaped.tolist() == pytest.approx([r - sum(raw) / len(raw) for r in raw])

    masks = [[1, 1, 0], [1], [0, 1], [1, 1], [1], [1, 1, 1]]
    columns = {"rewards": shaped.tolist(), "loss_mask": masks}
    compute_advantages_and_returns(columns, config)
    for adv, mask, reward in zip(columns["advantages"], masks, shaped.tolist(), strict=True):
        assert adv.tolist() == pytest.approx([reward] * len(mask))  # the rule: broadcast_reward


def test_the_batch_mean_estimator_refuses_the_settings_its_spec_does_not_declare(
    batch_mean_estimator,
):
    with pytest.raises(ValueError, match=r"--kl-coef 0\.1 would be ignored"):
        LossConfig(advantage_estimator="reinforce_batch_mean", kl_coef=0.1)
    with pytest.raises(ValueError, match=r"--gamma 0\.9 is ignored"):
        LossConfig(advantage_estimator="reinforce_batch_mean", gamma=0.9)


@pytest.fixture
def my_losses(tmp_path, monkeypatch):
    write_modules(GUIDE, ["my_losses.py"], tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_losses", None)


def test_a_custom_spec_declares_its_inputs_and_a_plain_function_gets_the_defaults(my_losses):
    spec = LossConfig(loss_type="custom_loss", custom_loss_function_path="my_losses:REINFORCE")
    plain = LossConfig(loss_type="custom_loss", custom_loss_function_path="my_losses:reinforce")
    assert Algorithm.from_config(spec).inputs == {"advantages"}
    assert Algorithm.from_config(plain).inputs == {"old_log_probs", "advantages"}

    batch = {
        "log_probs": torch.tensor([-0.5, -1.0, -2.0, -0.1, -0.3], dtype=torch.float64),
        "advantages": torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0], dtype=torch.float64),
        "loss_mask": torch.tensor([1, 1, 0, 1, 1]),
        "response_lengths": [3, 2],
    }
    config = LossConfig(
        loss_type="custom_loss", custom_loss_function_path="my_losses:REINFORCE",
        loss_reduction="token_mean",
    )  # fmt: skip
    fn = Algorithm.from_config(config).loss.loss_function
    value, metrics = fn(batch, config, LossNormalizer(num_samples=2, num_tokens=4))
    assert value.item() == pytest.approx(0.7 / 4)
    assert metrics["reinforce_loss"].tolist() == pytest.approx([0.7, 4.0])


def test_a_typo_in_the_custom_path_fails_when_the_config_is_built(my_losses):
    with pytest.raises(ValueError, match=r"--custom-loss-function-path.*did you mean 'REINFORCE'"):
        LossConfig(loss_type="custom_loss", custom_loss_function_path="my_losses:REINFORC")
