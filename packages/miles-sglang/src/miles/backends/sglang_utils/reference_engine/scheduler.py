"""The engine loop: one thread owns the model, admits requests, decodes the running batch.

Between two decode steps the loop admits waiting requests (one batched prefill), retires
finished ones, and runs queued commands (weight updates, memory release), so a command never
runs in the middle of a forward pass and in-flight sequences keep their KV cache across it.

An idle engine lets a burst of requests arrive before its first prefill. A rollout sends all its
requests at once (a group each, or a sample each behind a router), and the server parses them one
after the other: in the e2e benchmark 64 sequences landed over 6-17 ms. An engine that starts on
the first alone prefills it, then prefills and merges the rest one step later, and decodes one
step more at the end for the one that started early: there, about 40 ms of a 210 ms rollout.

A finished sequence leaves its row in the batch until at least half the rows have finished (or
requests join, or the batch reaches the context length): dropping one copies every layer's cache
and makes the next step grow it anew, which costs more than half a decode step for the e2e
benchmark's 64 rows, while decoding a finished row along costs about 1/64 of a step. Its outputs
are dropped.

With LoRA serving, each request carries its adapter (or none) into the batch, and at most
--max-loras-per-batch distinct ones (the base model counting as one, as in SGLang) run together: a
request of another adapter waits until a running one leaves, while later requests of adapters
already running go ahead.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from miles.backends.sglang_utils.reference_engine.batch_cache import (
    BatchState,
    merge_states,
    select_rows,
)
from miles.backends.sglang_utils.reference_engine.lora_layers import LoraAdapter
from miles.backends.sglang_utils.reference_engine.model_runner import (
    ModelRunner,
    distinct_prompts,
)
from miles.backends.sglang_utils.reference_engine.prompt_logprobs import (
    PromptLogprobs,
    score_prompt,
)
from miles.backends.sglang_utils.reference_engine.sampling import (
    SamplingParams,
    sample_next_tokens,
    token_id_log_probs,
    top_log_probs,
)
from miles.backends.sglang_utils.reference_engine.vision_inputs import PromptImages

logger = logging.getLogger(__name__)

# The longest an idle engine waits for a burst of requests to land before its first prefill.
MAX_ADMISSION_WAIT_S = 0.05


# Request ids need to be unique, not unguessable: 128 random bits from a generator seeded once
# from the OS, where uuid4 asks the OS at every call (a syscall per sequence on the event loop
# while a rollout's requests are parsed).
_rids = random.Random()
os.register_at_fork(after_in_child=_rids.seed)  # a forked child draws its own ids
_rid_bits = _rids.getrandbits


def new_rid() -> str:
    """32 hex digits, the shape of SGLang's uuid4().hex request ids."""
    return f"{_rid_bits(128):032x}"


@dataclass(eq=False)
class Request:
    """One sequence to generate; `on_event(request, finished)` is called from the loop thread
    after every new token and once when it finishes."""

    input_ids: list[int]
    params: SamplingParams
    on_event: Callable[[Request, bool], None]
    rid: str = field(default_factory=new_rid)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    top_logprobs_num: int = 0
    """How many of the likeliest tokens to record at each step (OpenAI's top_logprobs)."""
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    logprob_start_len: int | None = None
    """The prompt position from which prompt log-probs are listed (SGLang's
    `logprob_start_len`); None for none (SGLang's default, -1)."""
    token_ids_logprob: list[int] | None = None
    """Tokens whose log-probs to record at every position (SGLang's `token_ids_logprob`)."""
    output_token_ids_logprobs: list[list[float]] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    """Set at prefill for a request that `scores_prompt`."""
    finish_reason: dict[str, Any] | None = None
    weight_version: str = ""
    generator: random.Random | None = None
    """The request's own draws, made at submit from its seed: the same seed gives the same
    tokens whatever else shares the batch."""
    stop_checker: Callable[[Request], str | None] | None = None
    cached_tokens: int = 0
    """Prompt tokens whose prefill this request shared with another (SGLang's `cached_tokens`)."""
    return_routed_experts: bool = False
    routed_experts: list[torch.Tensor] = field(default_factory=list)
    """With `return_routed_experts`: the experts of every token read, (n, layers, top_k) pieces
    in order (the prompt's, then one per decode step)."""
    adapter: LoraAdapter | None = None
    """The LoRA adapter the sequence runs with from its prefill to its end (None: base model)."""
    images: PromptImages | None = None
    """A vision-language model's prompt images, read at prefill (None: a text prompt)."""

    @property
    def scores_prompt(self) -> bool:
        """Whether the prefill must score the prompt: it lists prompt positions, or it generates
        nothing and lists the top / asked tokens after the prompt (SGLang does so)."""
        start = self.logprob_start_len
        if start is not None and start < len(self.input_ids):
            return True
        return self.params.max_new_tokens == 0 and bool(
            self.top_logprobs_num or self.token_ids_logprob
        )


class Scheduler:
    """Continuous batching over a `ModelRunner`; thread-safe entry points for the server."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        eos_token_ids: set[int],
        context_length: int,
        max_running_requests: int,
        seed: int,
        admission_quiet_s: float = 0.0,
        max_loras_per_batch: int | None = None,
    ) -> None:
        """`admission_quiet_s`: on an idle engine, how long no new request must have arrived
        before the first prefill (at most `MAX_ADMISSION_WAIT_S` in all); 0 admits at once.
        `max_loras_per_batch`: distinct adapters (None, the base model, counts) running at once;
        None: no bound."""
        if admission_quiet_s < 0:
            raise ValueError(f"admission_quiet_s must be >= 0, got {admission_quiet_s}")
        if max_loras_per_batch is not None and max_loras_per_batch < 1:
            raise ValueError(f"max_loras_per_batch must be >= 1, got {max_loras_per_batch}")
        self.max_loras_per_batch = max_loras_per_batch
        self.runner = runner
        self.admission_quiet_s = admission_quiet_s
        self._last_submit = 0.0  # time.monotonic() of the latest submit
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self.max_running_requests = max_running_requests
        self.weight_version = "0"
        self._seed_source = random.Random(seed)
        self._waiting: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._held: deque[Request] = deque()
        """Taken from the queue, waiting for an adapter slot (--max-loras-per-batch); the loop
        thread's alone."""
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._running: list[Request] = []
        self._rows: list[int] = []
        """The batch row of each running request; the other rows finished and wait to be
        dropped (`_compact`)."""
        self._state: BatchState | None = None
        self._next_tokens: list[int] = []
        self._aborts: set[str] = set()
        self._abort_all = threading.Event()
        self._paused = threading.Event()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.steps = 0
        self.finished_requests = 0
        # Where the loop's time goes (seconds, summed over the engine's life): the model's
        # prefill and decode forwards, sampling, and whole steps (the rest is scheduling).
        self.step_seconds = {"prefill": 0.0, "decode": 0.0, "sampling": 0.0, "steps": 0.0}
        self._thread = threading.Thread(
            target=self._loop, name="reference-engine-loop", daemon=True
        )
        self._thread.start()

    # ---- entry points (any thread) -------------------------------------------------------
    def submit(self, request: Request) -> None:
        seed = request.params.seed
        if seed is None:
            with self._lock:
                seed = self._seed_source.getrandbits(62)
        request.generator = random.Random(seed)
        self._last_submit = time.monotonic()
        self._waiting.put(request)
        self._wake.set()

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        with self._lock:
            if abort_all:
                self._abort_all.set()
            elif rid:
                self._aborts.add(rid)
        self._wake.set()

    def pause(self) -> None:
        """Stop stepping; running requests keep their place and cache (SGLang "in_place")."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()
        self._wake.set()

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet admitted (approximate while the loop admits)."""
        return self._waiting.qsize() + len(self._held)

    def run_command(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the loop thread between two steps (even while paused)."""
        future: Future = Future()
        self._commands.put((fn, future))
        self._wake.set()
        return future

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- loop thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._run_commands()
            self._apply_aborts()
            if self._paused.is_set() or not (
                self._running or self._held or not self._waiting.empty()
            ):
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            if not self._running:
                self._await_quiet_intake()
            try:
                # Nothing the loop computes needs autograd, and inference mode also skips the
                # version counters and view tracking of each op: a few percent of a decode step
                # on CPU. Weight updates run outside it, as commands.
                with torch.inference_mode():
                    self._step()
            except Exception as err:  # a bug or OOM must fail the requests, not kill the loop
                # A decode forward runs the whole batch at once: no request can be singled out.
                logger.exception(
                    "engine step failed; aborting %d running requests", len(self._running)
                )
                for request in self._running:
                    self._finish(request, _engine_error(err))
                self._running, self._rows, self._state, self._next_tokens = [], [], None, []

    def _await_quiet_intake(self) -> None:
        """Wait until no request has arrived for `admission_quiet_s` (a burst has landed) or
        `MAX_ADMISSION_WAIT_S` has passed, so that its requests share one prefill."""
        if self.admission_quiet_s <= 0:
            return
        deadline = time.monotonic() + MAX_ADMISSION_WAIT_S
        while not self._stop.is_set():
            now = time.monotonic()
            until = min(self._last_submit + self.admission_quiet_s, deadline)
            if now >= until:
                return
            time.sleep(until - now)  # releases the GIL to the server threads parsing the burst

    def _run_commands(self) -> None:
        while not self._commands.empty():
            fn, future = self._commands.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except Exception as err:
                future.set_exception(err)

    def _apply_aborts(self) -> None:
        with self._lock:
            abort_all, rids = self._abort_all.is_set(), set(self._aborts)
            self._abort_all.clear()
            self._aborts.clear()
        if not abort_all and not rids:
            return
        pending = []
        while not self._waiting.empty():
            pending.append(self._waiting.get())
        for request in pending:
            if abort_all or request.rid in rids:
                self._finish(request, {"type": "abort", "message": "aborted by request"})
            else:
                self._waiting.put(request)
        for request in [r for r in self._held if abort_all or r.rid in rids]:
            self._held.remove(request)
            self._finish(request, {"type": "abort", "message": "aborted by request"})
        self._retire([r for r in self._running if abort_all or r.rid in rids], "aborted by request")

    def _take_admissible(self) -> list[Request]:
        """The waiting requests of the next prefill, oldest first, within --max-running-requests
        and --max-loras-per-batch; one whose adapter finds no slot is held for a later step."""
        earlier, self._held = self._held, deque()
        held_later: list[Request] = []  # held in this pass, taken from the queue
        slots = {r.adapter for r in self._running}
        new: list[Request] = []
        while len(self._running) + len(new) < self.max_running_requests:
            if earlier:
                request, held = earlier.popleft(), self._held
            elif not self._waiting.empty():
                request, held = self._waiting.get(), held_later
            else:
                break
            if request.params.max_new_tokens == 0 and not request.scores_prompt:
                self._finish(request, {"type": "length", "length": 0})
                continue
            limit = self.max_loras_per_batch
            if limit is not None and request.adapter not in slots and len(slots) >= limit:
                held.append(request)
                continue
            slots.add(request.adapter)
            new.append(request)
        self._held.extend([*earlier, *held_later])  # oldest first
        return new

    def _admit(self) -> None:
        new = self._take_admissible()
        if not new:
            return
        _, rows = distinct_prompts(
            [r.input_ids for r in new], [r.adapter for r in new], [r.images for r in new]
        )
        seen: set[int] = set()
        for request, row in zip(new, rows, strict=True):
            request.cached_tokens = len(request.input_ids) if row in seen else 0
            seen.add(row)
        admitted, (logits, state) = self._prefill(new)
        admitted, logits, state = self._finish_scoring_only(admitted, logits, state)
        if not admitted:
            return
        tokens = self._sample_and_record(admitted, logits)
        self._compact(now=True)  # merging copies every row: only the running ones
        first_row = self._state.size if self._state is not None else 0
        self._running += admitted
        self._rows += range(first_row, first_row + len(admitted))
        self._next_tokens += tokens
        self._state = merge_states(self._state, state)
        self._retire_finished()

    def _finish_scoring_only(
        self, requests: list[Request], logits: torch.Tensor | None, state: BatchState | None
    ) -> tuple[list[Request], torch.Tensor | None, BatchState | None]:
        """Finish the prefilled requests that generate nothing (max_new_tokens=0: they only
        wanted their prompt scored); the others, with their rows of the prefill's logits and
        state."""
        keep = [row for row, r in enumerate(requests) if r.params.max_new_tokens > 0]
        if len(keep) == len(requests):
            return requests, logits, state
        for request in requests:
            if request.params.max_new_tokens == 0:
                scored = request.prompt_logprobs
                # SGLang lists one output entry of top / asked-token log-probs for such a
                # request: the (unscaled) distribution after the prompt.
                if scored is not None and request.top_logprobs_num:
                    request.output_top_logprobs.append(scored.next_top)
                if scored is not None and request.token_ids_logprob:
                    request.output_token_ids_logprobs.append(scored.next_token_ids)
                self._finish(request, {"type": "length", "length": 0})
        if not keep:
            return [], None, None
        return [requests[row] for row in keep], logits[keep], select_rows(state, keep)

    def _prefill(
        self, requests: list[Request]
    ) -> tuple[list[Request], tuple[torch.Tensor, BatchState] | tuple[None, None]]:
        """One batched prefill; if it fails, each request alone, so a request that breaks the
        forward pass fails by itself (the running ones are untouched). Returns the prefilled
        requests and their (logits, state). Requests that `scores_prompt` get `prompt_logprobs`:
        a prompt that cannot be scored fails the same way."""
        start = time.perf_counter()
        try:
            logits, state, prompt_logits = self.runner.prefill_with_prompt_logits(
                [r.input_ids for r in requests],
                [r.scores_prompt for r in requests],
                [r.adapter for r in requests],
                [r.images for r in requests],
            )
            for request, row_logits in zip(requests, prompt_logits, strict=True):
                if row_logits is not None:
                    request.prompt_logprobs = self._score_prompt(request, row_logits)
            if self.runner.recorder is not None:
                for request, routed in zip(requests, self.runner.prefill_routed, strict=True):
                    if request.return_routed_experts:
                        request.routed_experts = [routed]
            return requests, (logits, state)
        except Exception as err:
            if len(requests) == 1:
                logger.exception("prefill of request %s failed", requests[0].rid)
                self._finish(requests[0], _engine_error(err))
                return [], (None, None)
            logger.exception(
                "a prefill of %d requests failed; prefilling each alone", len(requests)
            )
        finally:
            self.step_seconds["prefill"] += time.perf_counter() - start
        admitted, logits, states = [], [], None
        for request in requests:
            kept, (row_logits, state) = self._prefill([request])
            if kept:
                admitted.append(request)
                logits.append(row_logits)
                states = merge_states(states, state)
        if not admitted:
            return [], (None, None)
        return admitted, (torch.cat(logits), states)

    @staticmethod
    def _score_prompt(request: Request, logits: torch.Tensor) -> PromptLogprobs:
        start = request.logprob_start_len
        return score_prompt(
            logits,
            request.input_ids,
            len(request.input_ids) if start is None else start,
            request.top_logprobs_num,
            request.token_ids_logprob,
        )

    def _step(self) -> None:
        step_start = time.perf_counter()
        try:
            self._admit()
            if not self._running:
                return
            start = time.perf_counter()
            logits, routed_rows = self._decode_running()
            self.step_seconds["decode"] += time.perf_counter() - start
            if routed_rows is not None:
                for request, routed in zip(self._running, routed_rows, strict=True):
                    if request.return_routed_experts:
                        request.routed_experts.append(routed.unsqueeze(0))
            self._next_tokens = self._sample_and_record(self._running, logits)
            self.steps += 1
            self._retire_finished()
        finally:
            self.step_seconds["steps"] += time.perf_counter() - step_start

    def _decode_running(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of the batch: the running requests' next-token logits and (MoE)
        routed experts, in `_running`'s order. Finished rows still in the batch are fed token 0
        and their outputs dropped."""
        assert self._state is not None, "running requests have batch rows"
        if self._state.length >= self.context_length:
            # A finished row's positions run on with the batch: past the context they would
            # index a model's position table out of range.
            self._compact(now=True)
        if len(self._rows) == self._state.size:
            logits, self._state = self.runner.decode(self._state, self._next_tokens)
            return logits, self.runner.decode_routed
        tokens = [0] * self._state.size
        for row, token in zip(self._rows, self._next_tokens, strict=True):
            tokens[row] = token
        logits, self._state = self.runner.decode(self._state, tokens)
        rows = torch.tensor(self._rows, device=logits.device)
        routed = self.runner.decode_routed
        if routed is not None:
            routed = routed.index_select(0, rows.to(routed.device))
        return logits.index_select(0, rows), routed

    def _sample_and_record(self, requests: list[Request], logits: torch.Tensor) -> list[int]:
        """Sample each request's next token and record it. A request whose sampling or stop
        check fails is marked finished with the error (and retired with the finished ones);
        the others go on."""
        start = time.perf_counter()
        failed: dict[int, Exception] = {}
        try:
            tokens, log_probs = sample_next_tokens(
                logits, [r.params for r in requests], [r.generator for r in requests]
            )
        except Exception:
            logger.exception("sampling %d requests failed; sampling each alone", len(requests))
            tokens, log_probs = [0] * len(requests), [0.0] * len(requests)
            for row, request in enumerate(requests):
                try:
                    (tokens[row],), (log_probs[row],) = sample_next_tokens(
                        logits[row : row + 1], [request.params], [request.generator]
                    )
                except Exception as err:
                    failed[row] = err
        params = [r.params for r in requests]
        tops = _asked_for(
            "top log-probs", [r.top_logprobs_num for r in requests], failed,
            lambda counts: top_log_probs(logits, params, counts),
        )  # fmt: skip
        by_id = _asked_for(
            "token-id log-probs", [r.token_ids_logprob for r in requests], failed,
            lambda asked: token_id_log_probs(logits, params, asked),
        )  # fmt: skip
        self.step_seconds["sampling"] += time.perf_counter() - start
        for row, (request, token, log_prob) in enumerate(
            zip(requests, tokens, log_probs, strict=True)
        ):
            if row in failed:
                request.finish_reason = _engine_error(failed[row])
                continue
            # The token goes in last: a server thread that reads len(output_ids) finds the
            # log-probs of every token it counts.
            request.output_logprobs.append(log_prob)
            if tops is not None and request.top_logprobs_num:
                request.output_top_logprobs.append(tops[row])
            if by_id is not None and request.token_ids_logprob:
                request.output_token_ids_logprobs.append(by_id[row])
            request.output_ids.append(token)
            request.weight_version = self.weight_version
            try:
                request.finish_reason = self._finish_reason(request, token)
            except Exception as err:
                logger.exception("the stop check of request %s failed", request.rid)
                request.finish_reason = _engine_error(err)
            if request.finish_reason is None:
                request.on_event(request, False)
        return tokens

    def _finish_reason(self, request: Request, token: int) -> dict[str, Any] | None:
        params = request.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return {"type": "stop", "matched": token}
        if token in params.stop_token_ids:
            return {"type": "stop", "matched": token}
        if (
            request.stop_checker is not None
            and (matched := request.stop_checker(request)) is not None
        ):
            return {"type": "stop", "matched": matched}
        if len(request.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": len(request.output_ids)}
        if len(request.input_ids) + len(request.output_ids) >= self.context_length:
            return {"type": "length", "length": len(request.output_ids)}
        return None

    def _retire_finished(self) -> None:
        done = [r for r in self._running if r.finish_reason is not None]
        if done:
            self._retire(done, None)

    def _retire(self, requests: list[Request], abort_message: str | None) -> None:
        if not requests:
            return
        leaving = {id(r) for r in requests}
        keep = [i for i, r in enumerate(self._running) if id(r) not in leaving]
        for request in requests:
            reason = request.finish_reason
            if abort_message is not None:
                reason = {"type": "abort", "message": abort_message}
            self._finish(request, reason)
        self._next_tokens = [self._next_tokens[i] for i in keep]
        self._running = [self._running[i] for i in keep]
        self._rows = [self._rows[i] for i in keep]
        self._compact()

    def _compact(self, now: bool = False) -> None:
        """Drop the finished rows from the batch once they are at least half of it (any of them
        `now`); an empty batch is dropped at once."""
        if self._state is None or len(self._rows) == self._state.size:
            return
        finished = self._state.size - len(self._rows)
        if not self._rows:
            self._state = None
        elif now or finished >= len(self._rows):
            self._state = select_rows(self._state, self._rows)
            self._rows = list(range(len(self._rows)))

    def _finish(self, request: Request, reason: dict[str, Any]) -> None:
        self.finished_requests += 1
        request.finish_reason = reason
        request.weight_version = request.weight_version or self.weight_version
        request.on_event(request, True)

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """True once nothing is running or waiting (used before releasing memory)."""
        deadline = time.monotonic() + timeout_s
        while self._running or self._held or not self._waiting.empty():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True


def _asked_for(
    what: str, wanted: list[Any], failed: dict[int, Exception], compute: Callable[[list[Any]], Any]
) -> Any:
    """`compute(wanted)` when some request asked (a truthy entry of `wanted`), else None. If it
    fails, only the requests that asked fail: their rows go into `failed`."""
    if not any(wanted):
        return None
    try:
        return compute(wanted)
    except Exception as err:
        logger.exception("%s of %d requests failed", what, sum(map(bool, wanted)))
        failed.update({row: err for row, asked in enumerate(wanted) if asked})
        return None


def _engine_error(err: Exception) -> dict[str, Any]:
    """The finish reason of a request that failed inside the engine: SGLang's abort type, with
    the status code SGLang gives a failure (an abort someone asked for has none)."""
    return {
        "type": "abort",
        "message": f"engine error: {type(err).__name__}: {err}",
        "status_code": 500,
    }
