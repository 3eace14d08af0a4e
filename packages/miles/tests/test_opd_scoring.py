"""Teacher scoring for on-policy distillation on a real reference engine over HTTP: the engine's
prompt log-probs of a sample's response tokens equal the trainer's log-prob function over a
float64 transformers forward of the same tokens; masked tokens drop out of the KL metric; a
sample without a prompt token or a mismatched answer is refused."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.backends.training_utils.batching.sample import Sample
from miles.backends.training_utils.step.logprobs import get_log_probs_and_entropy
from miles.rollout.engine_pool import EnginePool
from miles.rollout.opd import (
    response_log_probs,
    response_top_tokens,
    score_with_teacher,
    scoring_request,
    teacher_kl_metrics,
)

SAMPLES = [
    ([10, 20, 30], [40, 50, 60, 70]),
    ([5], [6, 7]),
    ([100, 101, 102, 103, 104, 105], [3]),
]


def make_sample(index: int, prompt: list[int], response: list[int]) -> Sample:
    return Sample(index=index, tokens=prompt + response, response_length=len(response))


def trainer_log_probs(model, sample: Sample) -> torch.Tensor:
    """The trainer's response log-probs (training_utils.step.logprobs) from a float64 forward."""
    ids = torch.tensor([sample.tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]  # (L, V)
    positions = torch.arange(sample.prompt_length - 1, len(sample.tokens) - 1)
    log_probs, _ = get_log_probs_and_entropy(
        logits[positions], ids[0, positions + 1], temperature=1.0
    )
    return log_probs


def test_teacher_scores_equal_the_trainers_log_probs_of_the_same_tokens(
    engine_url, tiny_checkpoint
):
    groups = [[make_sample(i, p, r) for i, (p, r) in enumerate(SAMPLES)]]

    async def score() -> None:
        async with EnginePool([engine_url]) as pool:
            await score_with_teacher(pool, groups)

    asyncio.run(score())
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float64).eval()
    for sample in groups[0]:
        assert len(sample.teacher_log_probs) == sample.response_length
        want = trainer_log_probs(model, sample)
        got = torch.tensor(sample.teacher_log_probs, dtype=torch.float64)
        torch.testing.assert_close(got, want.double(), atol=1e-4, rtol=0)


def test_teacher_top_tokens_are_the_trainers_top_log_probs_at_every_response_position(
    engine_url, tiny_checkpoint
):
    groups = [[make_sample(i, p, r) for i, (p, r) in enumerate(SAMPLES)]]

    async def score() -> None:
        async with EnginePool([engine_url]) as pool:
            await score_with_teacher(pool, groups, top_k=5)

    asyncio.run(score())
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float64).eval()
    for sample in groups[0]:
        ids = torch.tensor([sample.tokens])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]  # (L, V)
        positions = torch.arange(sample.prompt_length - 1, len(sample.tokens) - 1)
        log_p = torch.log_softmax(logits[positions], -1)  # (R, V), the model's own distribution
        got_ids = torch.tensor(sample.teacher_top_ids)  # (R, 5)
        assert got_ids.shape == (sample.response_length, 5)
        # Likeliest first, and each listed value is the float64 log-prob of the listed id.
        got = torch.tensor(sample.teacher_top_log_probs, dtype=torch.float64)
        torch.testing.assert_close(got, log_p.gather(-1, got_ids), atol=1e-4, rtol=0)
        assert (got[:, :-1] >= got[:, 1:]).all()
        torch.testing.assert_close(got, log_p.topk(5, dim=-1).values, atol=1e-4, rtol=0)


def test_a_top_token_answer_of_another_width_is_refused():
    sample = make_sample(3, [1, 2], [3, 4])
    answer = {"input_top_logprobs": [None, [[-0.1, 7, None]], [[-0.2, 8, None], [-0.9, 1, None]]]}
    with pytest.raises(ValueError, match=r"listed 2 positions of \[1, 2\] top tokens for sample 3"):
        response_top_tokens(sample, answer, 2)
    answer["input_top_logprobs"][1].append([-0.3, 5, None])
    assert response_top_tokens(sample, answer, 2) == (
        [[7, 5], [8, 1]],
        [[-0.1, -0.3], [-0.2, -0.9]],
    )
    assert scoring_request(sample, 2)["top_logprobs_num"] == 2
    assert "top_logprobs_num" not in scoring_request(sample)


def test_the_request_scores_from_the_last_prompt_token_and_generates_nothing():
    body = scoring_request(make_sample(0, [1, 2, 3], [4, 5]))
    assert body["input_ids"] == [1, 2, 3, 4, 5]
    assert body["logprob_start_len"] == 2 and body["return_logprob"] is True
    assert body["sampling_params"]["max_new_tokens"] == 0
    with pytest.raises(ValueError, match="has no prompt token"):
        scoring_request(make_sample(7, [], [4, 5]))


def test_an_answer_for_other_tokens_is_refused():
    sample = make_sample(3, [1, 2], [3, 4])
    answer = {"input_token_logprobs": [[None, 2, None], [-0.5, 3, None], [-0.7, 9, None]]}
    with pytest.raises(ValueError, match=r"scored tokens \[3, 9\].*for sample 3"):
        response_log_probs(sample, answer)
    assert response_log_probs(sample, {"input_token_logprobs": [[None, 2, None], [-0.5, 3, None],
                                                                [-0.7, 4, None]]}) == [-0.5, -0.7]  # fmt: skip
    with pytest.raises(ValueError, match=r"without meta_info\.input_token_logprobs"):
        response_log_probs(sample, {})


def test_the_kl_metric_counts_trainable_tokens_only():
    sample = make_sample(0, [1], [2, 3, 4])
    sample.rollout_log_probs = [-1.0, -2.0, -3.0]
    sample.teacher_log_probs = [-1.5, -1.0, -9.0]
    sample.loss_mask = [1, 1, 0]  # the third token is tool output
    # ((-1 + 1.5) + (-2 + 1)) / 2
    assert teacher_kl_metrics([[sample]]) == {"opd/teacher_kl": pytest.approx(-0.25)}
    assert teacher_kl_metrics([[make_sample(1, [1], [2])]]) == {}
