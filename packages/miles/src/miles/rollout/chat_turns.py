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
        self,
        tokenizer: Any,
        template: ChatTemplate,
        tools: list[dict[str, Any]] | None = None,
        processor: Any = None,
    ) -> None:
        """`processor`: the checkpoint's (a VLM's), for conversations whose first prompt holds
        images: it expands each image's placeholder to the model's image tokens."""
        self.tokenizer, self.template, self.tools = tokenizer, template, tools
        self.processor = processor
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
        # A template that cannot continue a chat fails here, at the start, not in a rollout.
        self.after([], [{"role": "tool" if tools else "user", "content": _MARK}])

    def _render(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        extra = {"tools": self.tools} if self.tools else {}
        return self.template.render(
            self.tokenizer, messages, generation_prompt=generation_prompt, **extra
        )

    def encode(self, text: str) -> list[int]:
        # The template writes its own special tokens, as the data source's prompts do. Half a
        # UTF-16 pair (a tool may echo one) has no UTF-8: it is written as U+FFFD.
        text = text.encode("utf-8", "replace").decode("utf-8")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def first(self, messages: list[dict[str, Any]], images: list[str] | None = None) -> list[int]:
        """The opening prompt: `messages`, then the generation prompt; with `images` (the
        sample's, in the order the messages place them) through the processor, which expands
        each image's placeholder to its tokens."""
        text = self._render(messages, generation_prompt=True)
        if not images:
            return self.encode(text)
        if self.processor is None:
            raise ValueError(
                "the conversation has images but no processor reads them: pass --multimodal-keys "
                "with a vision-language checkpoint"
            )
        from miles.rollout.prompt_images import processor_prompt_ids

        return processor_prompt_ids(self.processor, text, images)

    def after(self, completion_ids: list[int], new_messages: list[dict[str, Any]]) -> list[int]:
        """The ids to append after a completion: the rest of the template's turn end (all of it
        when the model stopped without writing it, e.g. cut by a length limit), `new_messages`
        as the template writes them, and the next generation prompt."""
        if not new_messages:
            raise ValueError("a new turn needs at least one new message (a tool result, a user's)")
        opened = self._render([*self._base, *new_messages], generation_prompt=True)
        # What follows the assistant's content. Only that is new: what precedes it may be written
        # otherwise now that it is no longer the last turn (Qwen3 drops the empty thinking block
        # of earlier answers), but those are ids already recorded, never rendered again.
        at = opened.find(_MARK, opened.find(_MARK) + len(_MARK))
        tail = opened[at + len(_MARK) :] if at >= 0 else ""
        if at < 0 or not tail.startswith(self.turn_end):
            raise ValueError(
                "the chat template does not end an assistant turn the same way once new messages "
                "follow it, so a conversation cannot grow token by token with it; use another "
                "template (--chat-template-path)"
            )
        return self.encode(self._closing(completion_ids) + tail[len(self.turn_end) :])

    def _closing(self, completion_ids: list[int]) -> str:
        """What of the template's turn end the completion did not write: what follows its last
        token where that is a special token the turn end holds (Qwen's <|im_end|>, Llama's
        </s>), else all of it (the model was cut off, or ended with another token)."""
        if not completion_ids or completion_ids[-1] not in set(self.tokenizer.all_special_ids):
            return self.turn_end
        last = self.tokenizer.decode(completion_ids[-1:], skip_special_tokens=False)
        if last not in self.turn_end:
            return self.turn_end
        return self.turn_end[self.turn_end.index(last) + len(last) :]

    def matches_template(
        self, messages: list[dict[str, Any]], ids: list[int], images: list[str] | None = None
    ) -> bool:
        """Whether rendering all of `messages` afresh (with the generation prompt) gives `ids`:
        False when the template would write an earlier answer otherwise than it was sampled,
        which the token-exact trajectory then differs from (and counts)."""
        return self.first(messages, images) == ids
