"""The teacher KL of on-policy distillation: the formula against float64 references and as a
property, its two ways into training (advantages, loss) through `PolicyTrainer` on a real
engine, and the settings refused before start-up."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.training_utils.algorithms.distillation import DistillationConfig
from miles.backends.training_utils.algorithms.loss import LossNormalizer, policy_loss, reduce_loss
from miles.backends.training_utils.algorithms.loss_config import LossConfig
from miles.backends.training_utils.algorithms.teacher_kl import (
    kl_loss_per_token,
    penalize_advantages,
    reverse_kl,
    topk_forward_kl,
)
from miles.backends.training_utils.step.train_engine import SCORED_TOKEN_IDS

from .test_trainer import TEMPERATURE, VOCAB, BigramEngine, batch, trainer

# -- the formula ---------------------------------------------------------------------------------


def test_penalized_advantages_equal_a_float64_reference():
    advantages = [torch.tensor([0.5, 0.5, 0.5]), torch.tensor([-1.0, -1.0])]
    student = [torch.tensor([-0.1, -2.0, -0.7]), torch.tensor([-3.0, -0.01])]
    teacher = [torch.tensor([-0.3, -0.5, -0.7]), torch.tensor([-1.0, -4.0])]
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0])]
    got = penalize_advantages(advantages, student, teacher, masks, coef=0.5)
    # A - 0.5 * (log p_s - log p_t) on trainable tokens; the masked third token keeps A.
    want = [
        torch.tensor([0.5 - 0.5 * 0.2, 0.5 - 0.5 * -1.5, 0.5], dtype=torch.float64),
        torch.tensor([-1.0 - 0.5 * -2.0, -1.0 - 0.5 * 3.99], dtype=torch.float64),
    ]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), w, atol=1e-6, rtol=0)


_LOG_PROB = st.floats(min_value=-20.0, max_value=0.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(_LOG_PROB, _LOG_PROB, st.floats(-5, 5), st.sampled_from([0.0, 1.0])),
        min_size=1,
        max_size=12,
    ),
    coef=st.floats(min_value=0.0, max_value=4.0),
)
def test_penalized_advantages_property(rows, coef):
    student, teacher, advantage, mask = (
        torch.tensor(c, dtype=torch.float64) for c in zip(*rows, strict=True)
    )
    (got,) = penalize_advantages([advantage], [student], [teacher], [mask], coef=coef)
    # Trainable tokens move by exactly -coef * KL_t; masked ones do not move.
    torch.testing.assert_close(got, advantage - coef * (student - teacher) * mask)
    torch.testing.assert_close(got[mask == 0], advantage[mask == 0])
    # A student that agrees with its teacher keeps its advantages.
    (same,) = penalize_advantages([advantage], [student], [student], [mask], coef=coef)
    torch.testing.assert_close(same, advantage)
    # Tokens the student likes more than the teacher lose advantage, the others gain.
    delta = (got - advantage)[mask == 1]
    kl = reverse_kl(student, teacher)[mask == 1]
    assert bool(((delta * kl) <= 0).all())


def test_the_loss_term_is_the_kl_at_the_start_and_its_gradient_the_reverse_kl_policy_gradient():
    old = torch.tensor([-0.2, -1.5, -3.0], dtype=torch.float64)
    teacher = torch.tensor([-0.9, -0.4, -3.0], dtype=torch.float64)
    log_probs = old.clone().requires_grad_(True)
    term = kl_loss_per_token(log_probs, old, teacher)
    torch.testing.assert_close(term.detach(), old - teacher)
    term.sum().backward()
    # d/d log p of exp(log p - log p_old) * KL at log p = log p_old: the KL itself.
    torch.testing.assert_close(log_probs.grad, old - teacher)


def test_mismatched_scores_are_refused():
    with pytest.raises(ValueError, match="same response tokens"):
        reverse_kl(torch.zeros(3), torch.zeros(4))


# -- through the train step -----------------------------------------------------------------------


@pytest.fixture
def teacher_dir(tmp_path) -> str:
    """A directory the config accepts as a teacher checkpoint (the step never reads it)."""
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def with_teacher(data: dict, seed: int = 1) -> dict:
    generator = torch.Generator().manual_seed(seed)
    data["teacher_log_probs"] = [
        (-3 * torch.rand(n, generator=generator)).tolist() for n in data["response_lengths"]
    ]
    return data


def policy_loss_reference(data: dict, log_probs, entropy):
    """The step's policy loss over the whole batch in float64 (one optimizer step: the old policy
    is the policy, the advantages are the rewards), with what the OPD terms reduce with:
    (loss, mask, config, normalizer)."""
    mask = torch.tensor([m for ms in data["loss_mask"] for m in ms], dtype=torch.float64)
    advantages = torch.cat(
        [torch.full((n,), float(r), dtype=torch.float64)
         for n, r in zip(data["response_lengths"], data["rewards"], strict=True)]
    )  # fmt: skip
    config, normalizer = LossConfig(), LossNormalizer(num_samples=8, num_tokens=int(mask.sum()))
    inputs = {
        "log_probs": log_probs, "entropy": entropy, "loss_mask": mask,
        "old_log_probs": log_probs.detach(), "advantages": advantages,
        "response_lengths": data["response_lengths"],
    }  # fmt: skip
    loss, _ = policy_loss(inputs, config, normalizer)
    return loss, mask, config, normalizer


def test_advantages_mode_subtracts_the_kl_from_the_estimators_advantages(teacher_dir):
    data = with_teacher(batch(masked=True))
    opd = DistillationConfig(use_opd=True, opd_kl_coef=0.5, opd_teacher_checkpoint=teacher_dir)
    engine = BigramEngine(dtype=torch.float64)
    run = trainer(engine, global_batch_size=8, distillation=opd)
    metrics = run.train(data)
    # The old policy's log-probs are taken before the step (the advantages need them).
    assert engine.calls == [("policy", 4), ("train", 4)]
    masks = [torch.tensor(m, dtype=torch.float64) for m in data["loss_mask"]]
    old = [torch.as_tensor(lp).double() for lp in data["old_log_probs"]]
    teacher = [torch.tensor(t, dtype=torch.float64) for t in data["teacher_log_probs"]]
    for adv, reward, s, t, m in zip(data["advantages"], data["rewards"], old, teacher, masks, strict=True):  # fmt: skip
        torch.testing.assert_close(adv.double(), reward - 0.5 * (s - t) * m, atol=1e-6, rtol=0)
    kl = torch.cat([(s - t) * m for s, t, m in zip(old, teacher, masks, strict=True)])
    want = float(kl.sum() / torch.cat(masks).sum())
    assert metrics[0]["train/opd_teacher_kl"] == pytest.approx(want, abs=1e-6)


def test_loss_mode_adds_the_reduced_kl_term_to_the_loss_gradient(teacher_dir):
    data = with_teacher(batch(masked=True))
    opd = DistillationConfig(
        use_opd=True, opd_kl_coef=0.3, opd_kl_mode="loss", opd_teacher_checkpoint=teacher_dir
    )
    engine = BigramEngine(dtype=torch.float64)
    trainer(engine, global_batch_size=8, distillation=opd).train(dict(data))
    # Reference: the whole batch in one float64 forward: policy loss + 0.3 x reduced KL term.
    reference = BigramEngine(dtype=torch.float64)
    log_probs, entropy, _ = reference._log_probs(reference.model, data)
    teacher = torch.tensor([t for ts in data["teacher_log_probs"] for t in ts], dtype=torch.float64)
    old = log_probs.detach()
    loss, mask, config, normalizer = policy_loss_reference(data, log_probs, entropy)
    term = reduce_loss(
        kl_loss_per_token(log_probs, old, teacher), mask, data["response_lengths"],
        config=config, normalizer=normalizer,
    )  # fmt: skip
    (loss + 0.3 * term).backward()
    # The step's per-token columns (teacher scores, advantages) are float32.
    torch.testing.assert_close(engine.last_grad, reference.model.weight.grad, atol=1e-7, rtol=0)


def with_teacher_top(data: dict, k: int, seed: int = 2) -> dict:
    """The teacher's top-k ids and log-probs (distinct ids, likeliest first) at every position."""
    generator = torch.Generator().manual_seed(seed)
    data[SCORED_TOKEN_IDS], data["teacher_top_log_probs"] = [], []
    for n in data["response_lengths"]:
        logits = torch.randn(n, VOCAB, generator=generator, dtype=torch.float64) * 2
        top = torch.log_softmax(logits, -1).topk(k, dim=-1)
        data[SCORED_TOKEN_IDS].append(top.indices.tolist())
        data["teacher_top_log_probs"].append(top.values.tolist())
    return data


def test_topk_mode_adds_the_forward_kl_from_the_teachers_top_tokens_to_the_loss(teacher_dir):
    data = with_teacher_top(with_teacher(batch(masked=True)), k=4)
    opd = DistillationConfig(
        use_opd=True, opd_kl_coef=0.7, opd_kl_mode="topk", opd_top_k=4,
        opd_teacher_checkpoint=teacher_dir,
    )  # fmt: skip
    engine = BigramEngine(dtype=torch.float64)
    metrics = trainer(engine, global_batch_size=8, distillation=opd).train(dict(data))
    # Reference, float64, the whole batch: the policy loss plus 0.7 x the reduced
    # sum_j p_T(j) (log p_T(j) - log p_S(j)), with the student's log-softmax written out here.
    reference = BigramEngine(dtype=torch.float64)
    rows, student_top = [], []
    for tokens, n, ids in zip(data["tokens"], data["response_lengths"], data[SCORED_TOKEN_IDS], strict=True):  # fmt: skip
        t = torch.as_tensor(tokens)
        logits = reference.model(t[len(tokens) - n - 1 : -1]) / TEMPERATURE  # (R, V)
        log_p = torch.log_softmax(logits, -1)
        rows.append(log_p.gather(-1, t[len(tokens) - n :].unsqueeze(-1)).squeeze(-1))
        student_top.append(log_p.gather(-1, torch.tensor(ids)))
    log_probs, scored = torch.cat(rows), torch.cat(student_top)  # (T,), (T, 4)
    teacher = torch.tensor(
        [r for rs in data["teacher_top_log_probs"] for r in rs], dtype=torch.float64
    )
    loss, mask, config, normalizer = policy_loss_reference(
        data, log_probs, torch.zeros_like(log_probs)
    )
    kl = (teacher.exp() * (teacher - scored)).sum(-1)  # (T,)
    term = reduce_loss(kl, mask, data["response_lengths"], config=config, normalizer=normalizer)
    (loss + 0.7 * term).backward()
    torch.testing.assert_close(engine.last_grad, reference.model.weight.grad, atol=1e-7, rtol=0)
    want = float((kl.detach() * mask).sum() / mask.sum())
    assert metrics[0]["train/opd_topk_kl"] == pytest.approx(want, abs=1e-6)


def test_topk_forward_kl_is_zero_where_the_student_matches_the_teacher_and_positive_elsewhere():
    teacher = torch.log_softmax(torch.randn(5, 9, dtype=torch.float64), -1).topk(3, dim=-1).values
    assert torch.equal(
        topk_forward_kl(teacher.clone(), teacher), torch.zeros(5, dtype=torch.float64)
    )
    # Less mass on the teacher's tokens costs sum_j p_T(j) x the log-ratio.
    lower = teacher - 0.5
    torch.testing.assert_close(topk_forward_kl(lower, teacher), 0.5 * teacher.exp().sum(-1))
    with pytest.raises(ValueError, match=r"student log-probs \(5, 2\) of the teacher's top"):
        topk_forward_kl(teacher[:, :2], teacher)


def test_the_step_refuses_a_batch_without_teacher_scores(teacher_dir):
    opd = DistillationConfig(use_opd=True, opd_teacher_checkpoint=teacher_dir)
    with pytest.raises(ValueError, match=r"no 'teacher_log_probs'"):
        trainer(BigramEngine(), distillation=opd).train(batch())


# -- settings -------------------------------------------------------------------------------------


def test_a_teacher_checkpoint_is_checked_to_exist(tmp_path):
    with pytest.raises(ValueError, match="needs the teacher: pass --opd-teacher-checkpoint"):
        DistillationConfig(use_opd=True)
    with pytest.raises(ValueError, match=r"--opd-teacher-checkpoint .*does not exist"):
        DistillationConfig(use_opd=True, opd_teacher_checkpoint=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"holds no config\.json"):
        DistillationConfig(use_opd=True, opd_teacher_checkpoint=str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    config = DistillationConfig(use_opd=True, opd_teacher_checkpoint=str(tmp_path))
    assert config.opd_teacher_checkpoint == str(tmp_path) and config.kl_in_advantages


@pytest.mark.parametrize(
    ("settings_", "message"),
    [
        (
            {"opd_type": "megatron"},
            r"--opd-type megatron \(the teacher loaded inside the Megatron "
            r"trainer\) is not supported; supported: sglang",
        ),
        ({"opd_type": "vllm"}, "--opd-type vllm is not an OPD type; supported: sglang"),
        ({"opd_kl_coef": 0.5}, r"--opd-kl-coef \(0.5\) is only read with --use-opd"),
        ({"opd_kl_mode": "loss"}, r"--opd-kl-mode \(loss\) is only read with --use-opd"),
        ({"opd_teacher_num_engines": 0}, r"--opd-teacher-num-engines \(0\) must be a positive"),
        ({"use_opd": True, "opd_kl_coef": 0.0}, r"--opd-kl-coef \(0.0\) must be > 0"),
        ({"opd_top_k": 5}, r"--opd-top-k \(5\) is only read with --use-opd"),
        (
            {"use_opd": True, "opd_top_k": 5},
            r"--opd-top-k \(5\) is only read with --opd-kl-mode topk \(now advantages\)",
        ),
        (
            {"use_opd": True, "opd_kl_mode": "topk", "opd_top_k": 0},
            r"--opd-top-k \(0\) must be >= 1 with --opd-kl-mode topk",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(settings_, message, teacher_dir):
    if settings_.get("use_opd"):
        settings_ = {**settings_, "opd_teacher_checkpoint": teacher_dir}
    with pytest.raises(ValueError, match=message):
        DistillationConfig(**settings_)


def test_the_step_refuses_topk_mode_without_the_teachers_top_tokens(teacher_dir):
    opd = DistillationConfig(use_opd=True, opd_kl_mode="topk", opd_teacher_checkpoint=teacher_dir)
    with pytest.raises(ValueError, match=r"no \['teacher_top_ids', 'teacher_top_log_probs'\]"):
        trainer(BigramEngine(), distillation=opd).train(with_teacher(batch()))
