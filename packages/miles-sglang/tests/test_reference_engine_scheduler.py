"""The reference engine's scheduler when a step fails: every request still gets an answer (an
abort naming the error), newly admitted ones too, and the loop keeps serving afterwards."""

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
