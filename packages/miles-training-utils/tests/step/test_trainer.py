"""PolicyTrainer over a small real engine (a bigram language model in plain PyTorch): the step
computes only the inputs the loss reads, its gradient equals a float64 whole-batch reference,
dynamic micro-batches come in the same number on every rank, the step-0 gap is loss-mask
weighted, and bad batches are refused with the flag to fix."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist
from torch import nn

from miles.backends.training_utils.algorithms.algorithm import (
    Algorithm,
    compute_advantages_and_returns,
)
from miles.backends.training_utils.algorithms.loss import LossNormalizer, policy_loss
from miles.backends.training_utils.algorithms.loss_config import LossConfig
from miles.backends.training_utils.step.logprobs import get_log_probs_and_entropy
from miles.backends.training_utils.step.train_engine import (
    SCORED_TOKEN_IDS,
    OptimizerStepResult,
    TrainEngine,
)
from miles.backends.training_utils.step.trainer import PolicyTrainer
from tests.support.distributed import run_distributed
from tests.support.rollout_batches import random_rollout_batch

VOCAB = 32
TEMPERATURE = 0.7


class BigramEngine:
    """A `TrainEngine` whose model scores token t+1 from token t; it records what it was asked."""

    def __init__(self, *, seed: int = 0, dp_group=None, dtype=torch.float32) -> None:
        torch.manual_seed(seed)
        self.model = nn.Embedding(VOCAB, VOCAB, dtype=dtype)
        self.reference = nn.Embedding(VOCAB, VOCAB, dtype=dtype)
        self.reference.load_state_dict(self.model.state_dict())
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.context_parallel_size = 1
        self.engine_dtype = dtype
        self.calls: list[tuple[str, int]] = []  # (what, micro-batches)

    def _log_probs(self, model: nn.Module, micro: dict):
        """(log_probs, entropy, scored): scored are the log-probs of the micro-batch's
        SCORED_TOKEN_IDS (None without them), as the TrainEngine contract says."""
        log_probs, entropies, scored = [], [], []
        extra = micro.get(SCORED_TOKEN_IDS, [None] * len(micro["tokens"]))
        for tokens, response, ids_k in zip(
            micro["tokens"], micro["response_lengths"], extra, strict=True
        ):
            ids = torch.as_tensor(tokens)
            start = len(tokens) - response
            logits = model(ids[start - 1 : -1])  # (R, V): token t predicts t + 1
            targets = ids[start:]
            if ids_k is not None:  # (R, 1 + K): the target, then the scored ids
                targets = torch.cat([targets.unsqueeze(-1), torch.as_tensor(ids_k)], dim=-1)
            lp, ent = get_log_probs_and_entropy(logits, targets, temperature=TEMPERATURE)
            log_probs.append(lp if ids_k is None else lp[:, 0])
            scored.append(None if ids_k is None else lp[:, 1:])
            entropies.append(ent)
        top = None if scored[0] is None else torch.cat(scored)
        return torch.cat(log_probs), torch.cat(entropies), top

    def forward_log_probs(self, micro_batches: Sequence[dict], *, reference: bool = False):
        self.calls.append(("reference" if reference else "policy", len(micro_batches)))
        model = self.reference if reference else self.model
        with torch.no_grad():
            return [self._log_probs(model, m)[0].float() for m in micro_batches]

    def forward_backward(self, micro_batches, loss_fn):
        self.calls.append(("train", len(micro_batches)))
        metrics = []
        for index, micro in enumerate(micro_batches):
            loss, pairs = loss_fn(index, *self._log_probs(self.model, micro))
            loss.backward()
            metrics.append(pairs)
        return metrics

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def update_reference(self) -> None:
        self.reference.load_state_dict(self.model.state_dict())

    def optimizer_step(self) -> OptimizerStepResult:
        grad = self.model.weight.grad
        if self.dp_group is not None:  # gradients are averaged over replicas, as FSDP does
            dist.all_reduce(grad, group=self.dp_group)
            grad /= self.dp_size
        self.last_grad = grad.clone()
        norm = float(grad.norm())
        self.optimizer.step()
        return OptimizerStepResult(grad_norm=norm, lr=0.1, applied=True)

    def named_weights(self):
        yield "weight", self.model.weight.detach()

    def weights_on_device(self):
        return contextlib.nullcontext()

    def save(self, directory, rollout_id, extra): ...  # not used by the step

    def load(self, directory):
        return None

    def export_hf(self, path): ...

    def sleep(self): ...

    def wake_up(self): ...


def trainer(engine, loss: LossConfig | None = None, **kwargs) -> PolicyTrainer:
    settings = {"global_batch_size": 8, "micro_batch_size": 2, "max_tokens_per_gpu": None}
    return PolicyTrainer(engine, loss or LossConfig(), **{**settings, **kwargs})


def batch(num_samples: int = 8, seed: int = 0, **kwargs) -> dict:
    return random_rollout_batch(num_samples, seed=seed, vocab_size=VOCAB, **kwargs)


def test_the_bigram_engine_implements_the_protocol():
    assert isinstance(BigramEngine(), TrainEngine)


@pytest.mark.parametrize(
    ("loss", "steps", "calls"),
    [
        # One step: the old policy is the step's own forward, so no separate pass.
        (LossConfig(), 1, [("train", 4)]),
        (LossConfig(use_kl_loss=True, kl_loss_coef=0.1), 1, [("reference", 4), ("train", 4)]),
        # Two steps: the old policy's log-probs are taken once, before the first.
        (LossConfig(), 2, [("policy", 4), ("train", 2), ("train", 2)]),
        # SFT reads neither old-policy nor reference log-probs.
        (LossConfig(loss_type="sft_loss"), 2, [("train", 2), ("train", 2)]),
    ],
    ids=["one-step", "kl-loss", "two-steps", "sft"],
)
def test_the_step_runs_only_the_forwards_the_loss_reads(loss, steps, calls):
    engine = BigramEngine()
    metrics = trainer(engine, loss, global_batch_size=8 // steps).train(batch())
    assert engine.calls == calls
    assert len(metrics) == steps and [m["train/step"] for m in metrics] == list(range(1, steps + 1))


def test_one_step_equals_a_float64_whole_batch_reference():
    data = batch(masked=True)
    engine = BigramEngine(dtype=torch.float64)
    metrics = trainer(engine).train(dict(data))
    # Reference: the whole global batch in one forward, float64, same loss function.
    model = nn.Embedding(VOCAB, VOCAB, dtype=torch.float64)
    model.load_state_dict(BigramEngine(dtype=torch.float64).model.state_dict())
    reference = dict(data)
    compute_advantages_and_returns(reference, LossConfig())
    log_probs, entropy, _ = BigramEngine._log_probs(None, model, reference)
    inputs = {
        "log_probs": log_probs, "entropy": entropy, "old_log_probs": log_probs.detach(),
        "advantages": torch.cat(reference["advantages"]).double(),
        "loss_mask": torch.cat([torch.tensor(m, dtype=torch.float64) for m in data["loss_mask"]]),
        "response_lengths": data["response_lengths"],
    }  # fmt: skip
    tokens = int(inputs["loss_mask"].sum())
    loss, _ = policy_loss(inputs, LossConfig(), LossNormalizer(num_samples=8, num_tokens=tokens))
    loss.backward()
    # The step hands per-token columns (advantages, masks) over as float32: 1e-7 relative.
    torch.testing.assert_close(engine.last_grad, model.weight.grad, rtol=1e-6, atol=1e-8)
    assert metrics[0]["train/loss"] == pytest.approx(loss.item(), rel=1e-6)


def test_the_step0_gap_counts_only_trainable_tokens():
    data = batch(masked=True, rollout_log_prob=0.0)
    engine = BigramEngine()
    ours = trainer(engine).log_probs(data)
    masks = [torch.tensor(m, dtype=torch.float64) for m in data["loss_mask"]]
    want = sum(float((-o.double() * m).sum()) for o, m in zip(ours, masks, strict=True))
    want /= sum(float(m.sum()) for m in masks)
    unweighted = float(torch.cat(ours).double().abs().mean())
    gap = trainer(engine).logprob_gap(data)
    assert gap == pytest.approx(want, rel=1e-9)
    assert gap != pytest.approx(unweighted, rel=1e-6)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda t: t.train(batch(6)), r"holds 6 samples .* --global-batch-size \(8\)"),
        (lambda t: t.logprob_gap(batch()), r"--check-weight-sync-tolerance none"),
    ],
    ids=["batch-not-a-multiple", "gap-without-engine-log-probs"],
)
def test_bad_batches_are_refused_with_the_fix(make, message):
    with pytest.raises(ValueError, match=message):
        make(trainer(BigramEngine()))


def test_rollout_log_probs_are_required_where_a_setting_reads_them():
    with pytest.raises(ValueError, match=r"--use-rollout-logprobs .* no 'rollout_log_probs'"):
        trainer(BigramEngine(), use_rollout_logprobs=True).train(batch())
    tis = LossConfig(off_policy_correction="tis")
    with pytest.raises(ValueError, match=r"--off-policy-correction .* no 'rollout_log_probs'"):
        trainer(BigramEngine(), tis).train(batch())
    with pytest.raises(ValueError, match=r"--off-policy-correction tis with --use-rollout"):
        trainer(BigramEngine(), tis, use_rollout_logprobs=True)
    with pytest.raises(
        ValueError, match=r"--use-rollout-logprobs has no effect with --loss-type sft"
    ):
        trainer(BigramEngine(), LossConfig(loss_type="sft_loss"), use_rollout_logprobs=True)


def test_a_critic_estimator_needs_a_critic_engine_and_only_it_takes_one():
    ppo = LossConfig(advantage_estimator="ppo")
    assert Algorithm.from_config(ppo).estimator.needs_critic
    with pytest.raises(ValueError, match=r"ppo reads a critic's values, but no critic was given"):
        trainer(BigramEngine(), ppo)
    with pytest.raises(ValueError, match=r"grpo reads no values, but a critic was given"):
        trainer(BigramEngine(), LossConfig(), critic=BigramValueEngine())


class BigramValueEngine(BigramEngine):
    """A value model for the step's tests: the value of the state before token t + 1 is a
    learned scalar of token t (one column of an embedding)."""

    def _log_probs(self, model: nn.Module, micro: dict):
        values = []
        for tokens, response in zip(micro["tokens"], micro["response_lengths"], strict=True):
            ids = torch.as_tensor(tokens)
            start = len(tokens) - response
            values.append(model(ids[start - 1 : -1])[:, 0])  # (R,)
        values = torch.cat(values)
        return values, torch.zeros_like(values), None


def _reference_value_loss(values, old, returns, masks, clip: float, global_batch: int) -> float:
    """Float64, one document at a time: the mean over samples of each sample's mean clipped
    value loss over its trainable tokens (--loss-agg-mode's default, sample-mean)."""
    total = 0.0
    for v, o, r, m in zip(values, old, returns, masks, strict=True):
        v, o, r, m = (torch.as_tensor(x, dtype=torch.float64) for x in (v, o, r, m))
        clipped = o + (v - o).clamp(-clip, clip)
        per_token = 0.5 * torch.maximum((v - r) ** 2, (clipped - r) ** 2)
        total += float((per_token * m).sum() / m.sum().clamp(min=1.0))
    return total / global_batch


def test_ppo_values_advantages_and_the_critics_clipped_loss_match_a_float64_reference():
    """The critic scores the rollout before the policy's step; GAE turns rewards and those
    values into advantages and returns; the critic's first loss (values = the old ones) is the
    clipped value loss over packed micro-batches, as one document at a time in float64."""
    from miles.backends.training_utils.algorithms.formulas.returns import (
        get_gae_advantages_and_returns,
    )

    loss = LossConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.8, value_clip=0.2)
    critic = BigramValueEngine(seed=3)
    step = trainer(BigramEngine(), loss, critic=critic)
    data = batch(8, seed=4)
    metrics = step.train(data)
    masks = [torch.as_tensor(m, dtype=torch.float32) for m in data["loss_mask"]]
    with torch.no_grad():
        want_values = [
            critic_values for critic_values in BigramValueEngine(seed=3).forward_log_probs(
                [{"tokens": [t], "response_lengths": [r]}
                 for t, r in zip(data["tokens"], data["response_lengths"], strict=True)]
            )
        ]  # fmt: skip
    for got, want in zip(data["values"], want_values, strict=True):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-6, rtol=0)
    rewards = [torch.zeros(len(m)) for m in masks]
    for reward, mask, value in zip(rewards, masks, data["rewards"], strict=True):
        trainable = mask.nonzero()
        if len(trainable):
            reward[trainable[-1]] = value  # the sample's reward on its last trainable token
    advantages, returns = get_gae_advantages_and_returns(
        [r.double() for r in rewards], [v.double() for v in data["values"]],
        [m.double() for m in masks], 0.9, 0.8,
    )  # fmt: skip
    for name, wanted in (("advantages", advantages), ("returns", returns)):
        for got, want in zip(data[name], wanted, strict=True):
            torch.testing.assert_close(torch.as_tensor(got).double(), want, atol=1e-6, rtol=0)
    first = _reference_value_loss(
        data["values"], data["values"], data["returns"], data["loss_mask"], 0.2, 8
    )
    assert metrics[0]["critic/loss"] == pytest.approx(first, rel=1e-6, abs=1e-9)
    assert metrics[0]["critic/value_clipfrac"] == 0.0  # values are the old ones
    explained = metrics[0]["critic/explained_variance"]
    flat_r = torch.cat(
        [torch.as_tensor(r).double()[m.bool()] for r, m in zip(data["returns"], masks, strict=True)]
    )
    flat_v = torch.cat([v.double()[m.bool()] for v, m in zip(data["values"], masks, strict=True)])
    want = 1 - float((flat_r - flat_v).var(unbiased=False) / flat_r.var(unbiased=False))
    assert explained == pytest.approx(want, rel=1e-6)
    want_variance = float(flat_r.var(unbiased=False))
    assert metrics[0]["critic/returns_variance"] == pytest.approx(want_variance, rel=1e-6)


def test_a_critic_on_ranks_of_its_own_takes_the_same_steps_as_one_on_the_policys():
    """The three calls of a critic on its own ranks (its values, the policy's step with them,
    the critic's step on the returns the policy left) give the policy and the critic exactly the
    weights and metrics of one step with the critic on the policy's ranks."""
    from miles.backends.training_utils.step.critic import CriticTrainer
    from miles.backends.training_utils.step.micro_batches import MicroBatcher

    loss = LossConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.8, value_clip=0.2)
    joint_policy, joint_critic = BigramEngine(seed=1), BigramValueEngine(seed=3)
    joint = trainer(joint_policy, loss, critic=joint_critic).train(batch(16, seed=4))

    policy, critic_engine = BigramEngine(seed=1), BigramValueEngine(seed=3)
    split = trainer(policy, loss, critic_on_own_ranks=True)
    critic = CriticTrainer(
        critic_engine, loss, global_batch_size=8,
        micro_batches=MicroBatcher(critic_engine, micro_batch_size=2, max_tokens_per_gpu=None),
    )  # fmt: skip
    policy_data, critic_data = batch(16, seed=4), batch(16, seed=4)  # each side's own copy
    policy_data["values"] = critic.values(critic_data)
    steps = split.train(policy_data)
    critic_data["values"], critic_data["returns"] = policy_data["values"], policy_data["returns"]
    for step, critic_step in zip(steps, critic.train(critic_data), strict=True):
        step.update(critic_step)

    assert len(joint) == len(steps) == 2
    assert steps == joint  # every metric of both steps, bit for bit
    assert torch.equal(policy.model.weight, joint_policy.model.weight)
    assert torch.equal(critic_engine.model.weight, joint_critic.model.weight)
    with pytest.raises(ValueError, match=r"the batch has none: the critic on ranks of its own"):
        trainer(BigramEngine(), loss, critic_on_own_ranks=True).train(batch(8))


def _dynamic_on_two_ranks(rank: int) -> dict:
    from miles.backends.training_utils.batching.micro_batch import num_micro_batches

    engine = BigramEngine(dp_group=dist.group.WORLD)
    # At 16 tokens per micro-batch rank 0's shard alone needs 2, rank 1's 4.
    shard = batch(4, seed=5 if rank == 0 else 1)
    alone = num_micro_batches(shard["total_lengths"], 16)
    metrics = trainer(engine, micro_batch_size=None, max_tokens_per_gpu=16).train(shard)
    return {"alone": alone, "calls": engine.calls, "loss": metrics[0]["train/loss"]}


def test_dynamic_micro_batches_come_in_the_same_number_on_every_rank():
    results = run_distributed(_dynamic_on_two_ranks, 2)
    assert [r["alone"] for r in results] == [2, 4]
    assert results[0]["calls"] == results[1]["calls"] == [("train", 4)]
    assert results[0]["loss"] == pytest.approx(results[1]["loss"])
