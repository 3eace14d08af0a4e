"""An idle reference engine lets a burst of requests land before its first prefill
(`--admission-quiet-ms`): the sequences of a rollout's requests, parsed one after the other,
share one prefill of their prompt and decode in step, while a stream that never pauses is still served within the cap."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.backends.sglang_utils.reference_engine.model_runner import ModelRunner
from miles.backends.sglang_utils.reference_engine.sampling import SamplingParams
from miles.backends.sglang_utils.reference_engine.scheduler import Request, Scheduler

PROMPT = [72, 101, 108, 108, 111]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)


def _scheduler(model, quiet_s: float) -> Scheduler:
    return Scheduler(
        ModelRunner(model, torch.device("cpu")), eos_token_ids=set(), context_length=64,
        max_running_requests=64, seed=0, admission_quiet_s=quiet_s,
    )  # fmt: skip


class _Finished:
    """Counts finished requests and remembers when the first one finished."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.count = 0
        self.first_at: float | None = None
        self.all_done = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, request: Request, finished: bool) -> None:
        if not finished:
            return
        with self._lock:
            self.count += 1
            self.first_at = self.first_at or time.monotonic()
            if self.count == self.expected:
                self.all_done.set()


def _submit(scheduler: Scheduler, finished: _Finished, max_new_tokens: int = 4) -> None:
    scheduler.submit(
        Request(
            input_ids=PROMPT,
            params=SamplingParams(max_new_tokens=max_new_tokens),
            on_event=finished,
        )
    )


@pytest.mark.parametrize("quiet_s", [0.03, 0.0])
def test_a_burst_shares_one_prefill_when_the_idle_engine_waits_for_it(model, quiet_s):
    # One request, then seven more 5 ms later (a server parsing a rollout's requests one after
    # the other). With a 30 ms quiet window the engine waits for all eight and prefills their
    # prompt once; admitting at once (0) prefills it for the first alone, then again for the rest.
    scheduler = _scheduler(model, quiet_s)
    try:
        finished = _Finished(8)
        _submit(scheduler, finished)
        time.sleep(0.005 if quiet_s else 0.2)
        for _ in range(7):
            _submit(scheduler, finished)
        assert finished.all_done.wait(30)
        if quiet_s:
            assert scheduler.runner.prefilled_tokens == len(PROMPT)
        else:
            assert scheduler.runner.prefilled_tokens > len(PROMPT)
    finally:
        scheduler.shutdown()


def test_a_stream_that_never_pauses_is_served_within_the_cap(model):
    # Requests every 5 ms for 0.4 s never leave the intake quiet for 30 ms; the engine starts
    # after its cap (MAX_ADMISSION_WAIT_S, 50 ms) anyway, and the first one-token request
    # finishes long before the stream ends (without the cap: about 0.5 s).
    scheduler = _scheduler(model, 0.03)
    try:
        finished = _Finished(80)
        start = time.monotonic()
        for _ in range(80):
            _submit(scheduler, finished, max_new_tokens=1)
            time.sleep(0.005)
        assert finished.all_done.wait(30)
        assert finished.first_at is not None
        assert finished.first_at - start < 0.3
    finally:
        scheduler.shutdown()


def test_a_negative_quiet_window_is_refused(model, tiny_checkpoint):
    from miles.backends.sglang_utils.reference_engine.config import ReferenceEngineConfig

    with pytest.raises(ValueError, match=r"--admission-quiet-ms must be >= 0 .*got -1"):
        ReferenceEngineConfig(model_path=str(tiny_checkpoint), admission_quiet_ms=-1)
    with pytest.raises(ValueError, match="admission_quiet_s must be >= 0"):
        _scheduler(model, -0.5)
