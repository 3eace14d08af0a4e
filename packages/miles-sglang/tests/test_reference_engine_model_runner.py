"""Prefix sharing in the reference engine: a prompt that arrives several times in one admission (a
GRPO group's samples) is prefilled once, and every copy continues exactly as if prefilled alone."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.backends.sglang_utils.reference_engine.model_runner import ModelRunner
from miles.backends.sglang_utils.reference_engine.sampling import SamplingParams
from miles.backends.sglang_utils.reference_engine.scheduler import Request, Scheduler

GROUP_PROMPT = [72, 101, 108, 108, 111]
OTHER_PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def runner(tiny_checkpoint) -> ModelRunner:
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    return ModelRunner(model, torch.device("cpu"))


def test_repeated_prompts_are_prefilled_once_with_the_rows_of_a_lone_prefill(runner):
    before = runner.prefilled_tokens
    prompts = [GROUP_PROMPT, OTHER_PROMPT, GROUP_PROMPT, GROUP_PROMPT]
    logits, state = runner.prefill(prompts)
    assert runner.prefilled_tokens - before == len(GROUP_PROMPT) + len(OTHER_PROMPT)
    assert logits.shape[0] == state.size == 4
    for row, prompt in enumerate(prompts):
        alone_logits, alone = runner.prefill([prompt])
        real = state.mask[row].bool()  # the row's own positions, without the batch's padding
        torch.testing.assert_close(logits[row], alone_logits[0], rtol=1e-5, atol=1e-5)
        for layer in range(len(state.keys)):
            torch.testing.assert_close(state.keys[layer][row][:, real], alone.keys[layer][0])
            torch.testing.assert_close(state.values[layer][row][:, real], alone.values[layer][0])
    # The copies decode on their own: the same next-token logits as unshared rows.
    shared_next, _ = runner.decode(state, [1, 2, 1, 1])
    torch.testing.assert_close(shared_next[0], shared_next[2])
    alone_next, _ = runner.decode(runner.prefill([GROUP_PROMPT])[1], [1])
    torch.testing.assert_close(shared_next[3], alone_next[0], rtol=1e-5, atol=1e-5)


def test_a_group_admitted_together_reports_its_shared_prompt_as_cached_tokens(runner):
    scheduler = Scheduler(
        runner, eos_token_ids=set(), context_length=64, max_running_requests=8, seed=0
    )
    try:
        scheduler.pause()  # the whole group waits, then is admitted in one prefill
        finished_ids: set[str] = set()
        all_done = threading.Event()

        def on_event(request: Request, finished: bool) -> None:  # runs on the engine's thread
            if finished:
                finished_ids.add(request.rid)
                if len(finished_ids) == len(group):
                    all_done.set()

        group = [
            Request(
                input_ids=list(GROUP_PROMPT),
                params=SamplingParams(max_new_tokens=4, temperature=0.0),
                on_event=on_event,
            )
            for _ in range(3)
        ]
        for request in group:
            scheduler.submit(request)
        scheduler.resume()
        assert all_done.wait(timeout=30), "the group did not finish"
        assert [r.cached_tokens for r in group] == [0, len(GROUP_PROMPT), len(GROUP_PROMPT)]
        assert group[0].output_ids == group[1].output_ids == group[2].output_ids  # greedy
    finally:
        scheduler.shutdown()
