"""The reference engine's scheduler when a step fails: every request still gets an answer (an
abort naming the error), newly admitted ones too, the loop keeps serving afterwards, and a request
that breaks a batched prefill or sampling fails alone while its neighbours complete."""

from __future__ import annotations

import threading

import torch
from transformers import AutoModelForCausalLM

from miles.backends.sglang_utils.reference_engine.model_runner import ModelRunner
from miles.backends.sglang_utils.reference_engine.sampling import SamplingParams
from miles.backends.sglang_utils.reference_engine.scheduler import Request, Scheduler


def _request(input_ids: list[int], done: dict, event: threading.Event) -> Request:
    def on_event(request: Request, finished: bool) -> None:
        if finished:
            done[request.rid] = request.finish_reason
            event.set()

    return Request(input_ids=input_ids, params=SamplingParams(max_new_tokens=3), on_event=on_event)


def test_a_failing_prefill_answers_the_admitted_requests_and_the_loop_serves_on(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    scheduler = Scheduler(
        ModelRunner(model, torch.device("cpu")), eos_token_ids=set(), context_length=64,
        max_running_requests=4, seed=0,
    )  # fmt: skip
    try:
        done: dict = {}
        failed, served = threading.Event(), threading.Event()
        bad = _request([10**6], done, failed)  # no such token: the embedding lookup raises
        scheduler.submit(bad)
        assert failed.wait(30), "a request whose prefill failed was never answered"
        assert done[bad.rid]["type"] == "abort"
        assert "engine error" in done[bad.rid]["message"]

        good = _request([72, 101, 108], done, served)
        scheduler.submit(good)
        assert served.wait(30)
        assert done[good.rid]["type"] == "length" and len(good.output_ids) == 3
    finally:
        scheduler.shutdown()


def test_requests_that_break_a_batched_step_fail_alone_and_their_neighbours_complete(
    tiny_checkpoint,
):
    # What validation would refuse, handed to the scheduler directly: a token beyond the
    # vocabulary breaks the batched prefill (or the scoring of a prompt), a fractional top_k
    # breaks the batched sampling.
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    scheduler = Scheduler(
        ModelRunner(model, torch.device("cpu")), eos_token_ids=set(), context_length=64,
        max_running_requests=8, seed=0,
    )  # fmt: skip
    done: dict = {}
    finished = threading.Semaphore(0)

    def make(input_ids: list[int], params: SamplingParams) -> Request:
        def on_event(request: Request, last: bool) -> None:
            if last:
                done[request.rid] = request.finish_reason
                finished.release()

        return Request(input_ids=input_ids, params=params, on_event=on_event)

    try:
        scheduler.pause()  # admit all six in one batch
        good = [make([72, 101, 108], SamplingParams(max_new_tokens=12)) for _ in range(2)]
        bad_prefill = make([10**6], SamplingParams(max_new_tokens=12))
        bad_sampling = make([72, 105], SamplingParams(max_new_tokens=12))
        bad_sampling.params.top_k = 2.5  # torch.topk refuses a float k
        scoring = make([72, 101, 108], SamplingParams(max_new_tokens=0))
        bad_scoring = make([72, 105, 99], SamplingParams(max_new_tokens=0))
        scoring.logprob_start_len = bad_scoring.logprob_start_len = 0
        bad_scoring.token_ids_logprob = [10**6]
        batch = (good[0], bad_prefill, bad_sampling, scoring, bad_scoring, good[1])
        for request in batch:
            scheduler.submit(request)
        scheduler.resume()
        for _ in batch:
            assert finished.acquire(timeout=60), f"unanswered: {done}"
    finally:
        scheduler.shutdown()
    for request in good:
        assert done[request.rid] == {"type": "length", "length": 12}
        assert len(request.output_ids) == 12
    assert done[scoring.rid] == {"type": "length", "length": 0} and not scoring.output_ids
    assert len(scoring.prompt_logprobs.token) == 3
    for request in (bad_prefill, bad_sampling, bad_scoring):
        assert done[request.rid]["type"] == "abort"
        assert done[request.rid]["message"].startswith("engine error: ")
