"""Sequences that finish early keep their rows in the batch until at least half of it has
finished: the batch is not copied at every finish, and the sequences still running get the
tokens and log-probs they get alone."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.backends.sglang_utils.reference_engine.model_runner import ModelRunner
from miles.backends.sglang_utils.reference_engine.sampling import SamplingParams
from miles.backends.sglang_utils.reference_engine.scheduler import Request, Scheduler

PROMPTS = [[72, 101, 108], [108, 111, 32, 119], [111, 114], [108, 100, 33, 10, 72]]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)


def _run(
    model, lengths: list[int], prompts: list[list[int]], context_length: int = 64
) -> tuple[list[Request], list[int]]:
    """Generate from `prompts` (seeded by position) at once; the requests and the batch size of
    every decode step."""
    scheduler = Scheduler(
        ModelRunner(model, torch.device("cpu")), eos_token_ids=set(),
        context_length=context_length, max_running_requests=16, seed=0, admission_quiet_s=0.05,
    )  # fmt: skip
    sizes: list[int] = []
    decode = scheduler.runner.decode

    def counting_decode(state, tokens):
        sizes.append(state.size)
        return decode(state, tokens)

    scheduler.runner.decode = counting_decode  # type: ignore[method-assign]
    done = threading.Semaphore(0)
    requests = [
        Request(
            input_ids=prompt,
            params=SamplingParams(temperature=1.0, max_new_tokens=length, seed=100 + index),
            on_event=lambda request, finished: finished and done.release(),
        )
        for index, (prompt, length) in enumerate(zip(prompts, lengths, strict=True))
    ]
    try:
        for request in requests:
            scheduler.submit(request)
        for _ in requests:
            assert done.acquire(timeout=60)
    finally:
        scheduler.shutdown()
    return requests, sizes


def test_finished_rows_leave_the_batch_once_half_of_it_has_finished(model):
    # Eight sequences; four finish after 2, 3, 4 and 5 tokens, four run to 12. The batch keeps
    # its 8 rows until the fourth finishes (half of it), then decodes the 4 still running.
    lengths = [2, 3, 4, 5, 12, 12, 12, 12]
    requests, sizes = _run(model, lengths, PROMPTS * 2)
    assert [len(r.output_ids) for r in requests] == lengths
    assert sizes == [8] * 4 + [4] * 7, sizes
    # What each sequence gets alone: the same tokens, the same log-probs (to float error).
    for index, (request, prompt) in enumerate(zip(requests, PROMPTS * 2, strict=True)):
        alone = _run_alone(model, prompt, lengths[index], seed=100 + index)
        assert request.output_ids == alone.output_ids
        assert request.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)


def test_an_emptied_batch_is_dropped_and_the_next_request_starts_a_new_one(model):
    requests, sizes = _run(model, [3, 3], PROMPTS[:2])
    assert [len(r.output_ids) for r in requests] == [3, 3]
    assert sizes == [2, 2]  # the first token comes from the prefill


def test_finished_rows_leave_the_batch_when_it_reaches_the_context_length(model):
    # One sequence of a 12-token prompt finishes after 2 tokens; three of 2-token prompts run to
    # 12. Its positions run on with the batch (12 columns after the prefill, one more a step): at
    # 16, the context length, it leaves, though it is a quarter of the batch.
    prompts = [list(range(40, 52)), [72, 101], [108, 111], [32, 119]]
    requests, sizes = _run(model, [2, 12, 12, 12], prompts, context_length=16)
    assert [len(r.output_ids) for r in requests] == [2, 12, 12, 12]
    assert sizes == [4] * 4 + [3] * 7, sizes


def _run_alone(model, prompt: list[int], length: int, seed: int) -> Request:
    scheduler = Scheduler(
        ModelRunner(model, torch.device("cpu")), eos_token_ids=set(), context_length=64,
        max_running_requests=1, seed=0,
    )  # fmt: skip
    done = threading.Event()
    request = Request(
        input_ids=prompt,
        params=SamplingParams(temperature=1.0, max_new_tokens=length, seed=seed),
        on_event=lambda request, finished: finished and done.set(),
    )
    try:
        scheduler.submit(request)
        assert done.wait(60)
    finally:
        scheduler.shutdown()
    return request
