"""The token ids of a conversation's next turn, continuing the ids the model already produced.

An agent's conversation grows by turns: the model answers, then tool results or a user's message
follow, then the model answers again. Rendering the whole conversation afresh each turn and
tokenizing it again is not token-exact: the template may write an earlier answer differently
from the tokens the model sampled (reasoning dropped from old turns, whitespace, an answer cut by
a stop string), so the trainer would score tokens the policy never produced. `ChatTurns` renders
only what is new, the way the template writes it after a finished assistant turn, and appends it
to the recorded ids: the model's tokens always stay as they were (architecture.md: "Agentic
rollouts").
"""

from __future__ import annotations

from typing import Any

from miles.rollout.chat_template import ChatTemplate

# Content no real message holds: where the template puts an assistant turn's content.
_MARK = "\u2063miles-turn\u2063"


class ChatTurns:
    """One conversation's renderer: the first prompt, then each turn after a completion."""

    def __init__(
        self, tokenizer: Any, template: ChatTemplate, tools: list[dict[str, Any]] | None = None
    ) -> None:
        self.tokenizer, self.template, self.tools = tokenizer, template, tools
        # A finished exchange to render new messages after: its text is the same whatever
        # follows, so what follows it is exactly what the template writes for the new messages.
        self._base = [{"role": "user", "content": _MARK}, {"role": "assistant", "content": _MARK}]
        self._closed = self._render(self._base, generation_prompt=False)
        if self._closed.count(_MARK) != 2:
            raise ValueError(
                "the chat template does not write messages' content as given, so new turns "
                "cannot be rendered on their own; agentic rollouts need a template that does"
            )
        self.turn_end = self._closed[self._closed.rindex(_MARK) + len(_MARK) :]
        """What the template writes after an assistant turn's content (e.g. "<|im_end|>\\n")."""

    def _render(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        extra = {"tools": self.tools} if self.tools else {}
        return self.template.render(
            self.tokenizer, messages, generation_prompt=generation_prompt, **extra
        )

    def encode(self, text: str) -> list[int]:
        # The template writes its own special tokens, as the data source's prompts do.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def first(self, messages: list[dict[str, Any]]) -> list[int]:
        """The opening prompt: `messages`, then the generation prompt."""
        return self.encode(self._render(messages, generation_prompt=True))

    def after(self, completion_ids: list[int], new_messages: list[dict[str, Any]]) -> list[int]:
        """The ids to append after a completion: the rest of the template's turn end (all of it
        when the model stopped without writing it, e.g. cut by a length limit), `new_messages`
        as the template writes them, and the next generation prompt."""
        if not new_messages:
            raise ValueError("a new turn needs at least one new message (a tool result, a user's)")
        opened = self._render([*self._base, *new_messages], generation_prompt=True)
        if not opened.startswith(self._closed):
            raise ValueError(
                "the chat template writes earlier turns differently once new messages follow, so "
                "a conversation cannot grow token by token with it; use a template whose earlier "
                "turns do not depend on later ones (--chat-template-path)"
            )
        last = self.tokenizer.decode(completion_ids[-1:], skip_special_tokens=False)
        closing = self.turn_end[len(last) :] if last and self.turn_end.startswith(last) else None
        return self.encode(
            (self.turn_end if closing is None else closing) + opened[len(self._closed) :]
        )

    def matches_template(self, messages: list[dict[str, Any]], ids: list[int]) -> bool:
        """Whether rendering all of `messages` afresh (with the generation prompt) gives `ids`:
        False when the template would write an earlier answer otherwise than it was sampled,
        which the token-exact trajectory then differs from (and counts)."""
        return self.first(messages) == ids
