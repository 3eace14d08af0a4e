"""One agent episode, token for token: the chat requests of an agent's session become one
trajectory of the ids the engine read and wrote.

Each request of a session (OpenAI's chat-completions body) is turned into engine ids without
rendering again what the model wrote (architecture.md: "Agentic rollouts"): when its messages
continue the conversation the session answered so far, only the new messages are rendered
(`ChatTurns.after`) and appended to the recorded ids; the engine's completion is appended as it
came. A request that does not continue it (an agent that rewrote or summarized its history, or
changed its tools) starts a new trajectory, which the sample then holds; the rewrite is counted.

The run's sampling settings govern every turn (--rollout-temperature, --rollout-top-p, ...), so
the policy being trained is the one sampled: a request's own temperature, top_p, top_k, min_p
and seed are not used. Its max_tokens caps the turn, its stop strings and stop tokens are added
to the run's, and one of its stop strings that ends an answer is not part of the content (the
trajectory keeps its tokens).

A session is bounded: turns (--max-turns), response tokens (--rollout-max-response-len, which
counts the whole trajectory past the first prompt), and the engine's context. A request past a
bound is refused (HTTP 400) and ends the session as `truncated`. When the rollout aborts a
turn (a weight update, the batch is full) the agent gets HTTP 503 and the sample is handed back
to start again; an engine failure is the rollout's, not the agent's: it is raised again there.
"""

from __future__ import annotations

import asyncio
import enum
import json
import uuid
from typing import Any

from miles.backends.sglang_utils.client import EngineError
from miles.backends.sglang_utils.reference_engine.openai_protocol import (
    ChatCompletionBody,
    completion_id,
    now,
    usage,
)
from miles.backends.sglang_utils.token_spelling import TokenSpelling
from miles.backends.sglang_utils.tool_calls import parse_tool_calls
from miles.backends.training_utils.batching.sample import Sample, SampleStatus
from miles.rollout.chat_template import ChatTemplate
from miles.rollout.chat_turns import ChatTurns
from miles.rollout.engine_pool import EnginePool
from miles.rollout.sample_generation import as_weight_version, completion_of, finish_status
from miles.rollout.trajectory import Trajectory


class SessionEnd(enum.StrEnum):
    """How a session ended (`sample.metadata["session_end"]`), and the sample's status."""

    COMPLETED = "completed"
    """The agent returned; the status is that of the last turn (`truncated` when it was cut at
    its token limit)."""
    TURN_LIMIT = "turn_limit"
    """A request past --max-turns was refused: truncated."""
    TOKEN_LIMIT = "token_limit"
    """The trajectory used its whole --rollout-max-response-len: truncated."""
    CONTEXT_LIMIT = "context_limit"
    """The engine refused a turn that no longer fit its context: truncated."""
    TIMEOUT = "timeout"
    """The agent ran past --session-timeout-s: failed."""
    ERROR = "error"
    """The agent raised, or returned something other than a string or None: failed."""
    ABORTED = "aborted"
    """The rollout aborted a turn: the sample starts again from its prompt."""


class SessionError(Exception):
    """A request the session refuses, answered to the agent in OpenAI's error shape."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code

    def __reduce__(self) -> tuple:  # rebuilt from its arguments across Ray's boundaries
        return type(self), (self.status, self.args[0], self.code), self.__dict__

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": None, "code": self.code}}


class AgentSession:
    """The record of one agent's session: its trajectory, the conversation it continues, and
    the counts the sample reports."""

    def __init__(
        self,
        pool: EnginePool,
        tokenizer: Any,
        template: ChatTemplate,
        sampling_params: dict[str, Any],
        *,
        max_turns: int,
        spelling: TokenSpelling,
        processor: Any = None,
    ) -> None:
        self.id = uuid.uuid4().hex
        self.processor = processor
        self.images: list[str] = []
        """The trajectory's images (`image_url` parts of its first prompt) as data: URLs."""
        self.pool, self.tokenizer, self.template = pool, tokenizer, template
        self.params, self.max_turns, self.spelling = sampling_params, max_turns, spelling
        self.budget = sampling_params["max_new_tokens"]
        self.trajectory: Trajectory | None = None
        self.conversation: list[dict[str, Any]] = []
        """The messages the trajectory renders, the last being the latest answer as sent."""
        self.last_completion: list[int] = []
        self.answer, self.status = "", SampleStatus.COMPLETED
        self.turns = self.template_mismatches = self.history_rewrites = 0
        self.limit: SessionEnd | None = None
        self.aborted = False
        self.engine_failure: BaseException | None = None
        self.closed = False
        self.weight_version: str | None = None
        self._chats: dict[str, ChatTurns] = {}
        self._tools_key: str | None = None
        self._lock = asyncio.Lock()
        self._in_flight: set[asyncio.Task] = set()

    async def chat_completion(self, body: ChatCompletionBody) -> dict[str, Any]:
        """Answer one request as OpenAI's chat completion, recording the turn. Requests of a
        session are answered one at a time: a trajectory is a sequence."""
        async with self._lock:
            if self.closed:
                raise SessionError(404, f"session {self.id} has ended", "session_closed")
            if self.limit is not None:
                raise SessionError(400, f"this session has ended: {self.limit}", str(self.limit))
            _check_request(body)
            if self.turns >= self.max_turns:
                self.limit = SessionEnd.TURN_LIMIT
                raise SessionError(
                    400,
                    f"this session has had its {self.max_turns} turns (--max-turns)",
                    "session_turn_limit",
                )
            return await self._turn(body)

    async def _turn(self, body: ChatCompletionBody) -> dict[str, Any]:
        messages = [m.for_template() for m in body.messages]
        tools = (
            [t.model_dump(exclude_none=True) for t in body.tools]
            if body.parses_tool_calls
            else None
        )
        images = self._images(body)
        fresh, ids = await asyncio.to_thread(self._next_ids, messages, tools, images)
        used = 0 if fresh or self.trajectory is None else len(self.trajectory.response_ids)
        left = self.budget - used - (0 if fresh else len(ids))
        if left <= 0:
            self.limit = SessionEnd.TOKEN_LIMIT
            raise SessionError(
                400,
                f"this session's trajectory has used its {self.budget} response tokens "
                "(--rollout-max-response-len)",
                "context_length_exceeded",
            )
        sent = ids if fresh else [*self.trajectory.ids, *ids]
        response = await self._generate(sent, body, left, fresh, images)
        output_ids, log_probs = completion_of(response)
        if fresh:
            if self.trajectory is not None:
                self.history_rewrites += 1
            self.trajectory = Trajectory(ids)
            self._tools_key = _tools_key(tools)
            self.images = images
        else:
            self.trajectory.add_context(ids)
            mismatch = not await asyncio.to_thread(
                self._chat(tools).matches_template, messages, sent, images
            )
            self.template_mismatches += mismatch
        self.trajectory.add_completion(output_ids, log_probs)
        self.turns += 1
        self.last_completion = output_ids
        meta = response.get("meta_info") or {}
        if meta.get("weight_version") is not None:
            self.weight_version = as_weight_version(meta["weight_version"])
        self.status = finish_status(response)
        self.answer = response.get("text") or ""
        return self._answer(body, response, sent, output_ids, messages)

    def _images(self, body: ChatCompletionBody) -> list[str]:
        """The request's images (`image_url` parts, in order) as data: URLs; refused where the
        run's model reads none, or an image does not decode."""
        from pathlib import Path

        from miles.rollout.prompt_images import row_images

        urls = [url for message in body.messages for url in message.image_urls]
        if not urls:
            return []
        if self.processor is None:
            raise SessionError(
                400,
                "image_url parts need a vision-language model, and this run's reads no images: "
                "send text content (or train a VLM with --multimodal-keys)",
                "invalid_request_error",
            )
        try:
            return row_images("the request's messages", urls, Path.cwd())
        except ValueError as err:
            raise SessionError(400, str(err), "invalid_request_error") from None

    def _next_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        images: list[str],
    ) -> tuple[bool, list[int]]:
        """(True, the ids of a fresh prompt) or (False, the ids continuing the trajectory).

        Images are read in a trajectory's first prompt only: a request that continues it must
        carry the same ones (its messages render their places alike whatever the pixels), and
        new messages with images are refused."""
        chat = self._chat(tools)
        if (
            self.trajectory is not None
            and _tools_key(tools) == self._tools_key
            and len(messages) > len(self.conversation)
            and all(map(_same_message, messages, self.conversation))
            and images[: len(self.images)] == self.images
        ):
            if len(images) > len(self.images):
                raise SessionError(
                    400,
                    "images may come only in a session's first messages (its prompt); send the "
                    "new ones as text, or start a new conversation",
                    "invalid_request_error",
                )
            return False, chat.after(self.last_completion, messages[len(self.conversation) :])
        return True, chat.first(messages, images)

    def _chat(self, tools: list[dict[str, Any]] | None) -> ChatTurns:
        key = _tools_key(tools)
        if key not in self._chats:
            self._chats[key] = ChatTurns(self.tokenizer, self.template, tools, self.processor)
        return self._chats[key]

    async def _generate(
        self, ids: list[int], body: ChatCompletionBody, left: int, fresh: bool, images: list[str]
    ) -> dict[str, Any]:
        params = {**self.params, "max_new_tokens": min(left, body.max_new_tokens or left)}
        if params.get("sampling_seed") is not None:
            params["sampling_seed"] = params["sampling_seed"] + self.turns
        if body.stops:
            params["stop"] = [*params.get("stop", []), *body.stops]
        if body.stop_token_ids:
            params["stop_token_ids"] = [*params.get("stop_token_ids", []), *body.stop_token_ids]
        payload = {"input_ids": ids, "sampling_params": params, "return_logprob": True}
        if images:  # the prompt's images: their tokens are in the ids
            payload["image_data"] = images
        if body.logprobs and body.top_logprobs:
            payload["top_logprobs_num"] = body.top_logprobs
        task = asyncio.ensure_future(self.pool.generate(payload))
        self._in_flight.add(task)
        try:
            response = await task
        except EngineError as err:
            # The first prompt is the data's to fit; a later one outgrew the engine's context.
            if err.status == 400 and (not fresh or self.trajectory is not None):
                self.limit = SessionEnd.CONTEXT_LIMIT
                raise SessionError(
                    400, f"the engine refused the turn: {err}", "context_length_exceeded"
                ) from None
            self.engine_failure = err
            raise SessionError(502, f"the engine failed: {err}", "engine_error") from None
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a lost engine: the rollout sends the group again
            self.engine_failure = err
            raise SessionError(502, f"the engine failed: {err}", "engine_error") from None
        finally:
            self._in_flight.discard(task)
        if finish_status(response) == SampleStatus.ABORTED:
            self.aborted = True
            raise SessionError(
                503,
                "the rollout aborted this session (a weight update, or its batch is full); the "
                "sample will be run again",
                "session_aborted",
            )
        return response

    def _answer(
        self,
        body: ChatCompletionBody,
        response: dict[str, Any],
        sent: list[int],
        output_ids: list[int],
        messages: list[dict[str, Any]],
    ) -> dict[str, Any]:
        meta = response.get("meta_info") or {}
        matched = (meta.get("finish_reason") or {}).get("matched")
        text = self.answer
        if isinstance(matched, str) and matched in body.stops and text.endswith(matched):
            text = text[: -len(matched)]  # the agent's own stop string is not content
        calls = []
        if body.parses_tool_calls and self.status == SampleStatus.COMPLETED:
            parsed = parse_tool_calls(text, body.tool_names)
            calls = parsed.tool_calls
            if calls:
                text = parsed.content or ""
        message = {"role": "assistant", "content": text,
                   "tool_calls": [c.as_openai() for c in calls] or None}  # fmt: skip
        self.conversation = [*messages, _as_template_message(message)]
        reason = (
            "tool_calls" if calls else "length" if self.status == SampleStatus.TRUNCATED else "stop"
        )
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason,
                  "matched_stop": matched}  # fmt: skip
        if body.logprobs:
            tops = meta.get("output_top_logprobs") or [[] for _ in output_ids]
            entries = meta["output_token_logprobs"]
            choice["logprobs"] = {"content": [
                self.spelling.logprob_entry(int(e[1]), float(e[0]),
                                            [(float(t[0]), int(t[1])) for t in top or []])
                for e, top in zip(entries, tops, strict=True)
            ]}  # fmt: skip
        if body.return_prompt_token_ids:
            choice["prompt_token_ids"] = list(sent)
        if body.return_token_ids:
            choice["token_ids"] = list(output_ids)
        return {"id": completion_id("chatcmpl"), "object": "chat.completion", "created": now(),
                "model": body.model, "choices": [choice],
                "usage": usage(len(sent), len(output_ids))}  # fmt: skip

    async def close(self) -> None:
        """End the session: a turn still running is cancelled (its request aborted)."""
        self.closed = True
        for task in list(self._in_flight):
            task.cancel()
        await asyncio.gather(*self._in_flight, return_exceptions=True)

    def fill(self, sample: Sample, end: SessionEnd, answer: str | None) -> Sample:
        """`sample` holding the session's trajectory, with the status `end` gives it."""
        if self.limit is not None:  # the session ended at a bound: what the agent did next is moot
            end, status = self.limit, SampleStatus.TRUNCATED
        elif end == SessionEnd.COMPLETED:
            status = self.status
        else:
            status = SampleStatus.FAILED
        if self.trajectory is not None:
            self.trajectory.fill(sample)
            sample.images = list(self.images) or None  # what the trajectory's ids were made with
        if status == SampleStatus.FAILED:
            sample.loss_mask = [0] * sample.response_length  # the harness failed, not the policy
        if self.weight_version is not None:
            sample.weight_version = self.weight_version
        sample.response = answer if answer is not None else self.answer
        sample.status = status
        sample.metadata.update(
            session_end=str(end), turns=self.turns, template_mismatches=self.template_mismatches,
            history_rewrites=self.history_rewrites,
        )  # fmt: skip
        return sample


def _check_request(body: ChatCompletionBody) -> None:
    if body.n != 1:
        raise SessionError(
            400, f"n={body.n}: a session is one trajectory; send n=1 (the rollout samples "
            "--n-samples-per-prompt sessions per prompt)", "invalid_n",
        )  # fmt: skip
    if body.input_ids is not None:
        raise SessionError(
            400, "input_ids: a session renders its messages itself, to keep the trajectory "
            "token-exact; send messages", "invalid_input_ids",
        )  # fmt: skip
    if body.chat_template_kwargs:
        raise SessionError(
            400, "chat_template_kwargs: a session renders with the run's "
            "--apply-chat-template-kwargs, as the data source and evaluation do", "invalid_kwargs",
        )  # fmt: skip


def _tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools, sort_keys=True)


def _as_template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An answer's message as the conversation records it (arguments as objects, as templates
    and `Message.for_template` have them)."""
    out = {"role": "assistant", "content": message["content"] or ""}
    if message["tool_calls"]:
        out["tool_calls"] = [
            {"id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"],
                          "arguments": json.loads(c["function"]["arguments"])}}
            for c in message["tool_calls"]
        ]  # fmt: skip
    return out


def _same_message(sent: dict[str, Any], recorded: dict[str, Any]) -> bool:
    """Whether a request's message is the recorded one (tool-call ids aside: some agents make
    their own)."""
    return _message_key(sent) == _message_key(recorded)


def _message_key(message: dict[str, Any]) -> tuple:
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
        for c in message.get("tool_calls") or []
    )
    return (message["role"], message.get("content") or "", message.get("name"),
            message.get("tool_call_id") if message["role"] == "tool" else None, calls)  # fmt: skip
