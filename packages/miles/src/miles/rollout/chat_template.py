"""How a run renders chat messages into prompt text: the tokenizer's chat template, or the one of
--chat-template-path, with the variables of --apply-chat-template-kwargs. One object does it for
the data source and evaluation alike, so training and eval prompts are rendered the same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.backends.sglang_utils.chat_arguments import TEMPLATE_ARGUMENTS


def check_template_settings(
    *, apply_chat_template: bool, kwargs: Any, template_path: str | None
) -> None:
    """The checks of --apply-chat-template-kwargs and --chat-template-path, made at start-up."""
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(
            "--apply-chat-template-kwargs must be a JSON object of template variables, e.g. "
            f"'{{\"enable_thinking\": false}}', got {kwargs!r}"
        )
    shadowed = sorted(TEMPLATE_ARGUMENTS & set(kwargs))
    if shadowed:
        raise ValueError(
            f"--apply-chat-template-kwargs names {shadowed}: those are apply_chat_template's own "
            "arguments, not template variables; remove them"
        )
    if (kwargs or template_path) and not apply_chat_template:
        given = "--apply-chat-template-kwargs" if kwargs else "--chat-template-path"
        raise ValueError(f"{given} shapes the chat template: pass --apply-chat-template too")
    if template_path is not None and not Path(template_path).is_file():
        raise ValueError(
            f"--chat-template-path {template_path!r} is not a file; give a Jinja chat template"
        )


@dataclass(frozen=True)
class ChatTemplate:
    """Renders messages to the prompt text a model is asked to continue."""

    template: str | None = None
    """The template's Jinja source; None: the tokenizer's own."""
    variables: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, kwargs: dict[str, Any], template_path: str | None) -> ChatTemplate:
        template = Path(template_path).read_text() if template_path is not None else None
        return cls(template=template, variables=dict(kwargs))

    def render(
        self,
        tokenizer: Any,
        messages: list[dict[str, Any]],
        *,
        generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """`messages` (and `extra`, e.g. tools) through the template, by default followed by the
        generation prompt (the opening of the assistant's turn)."""
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt,
            chat_template=self.template, **{**self.variables, **extra},
        )  # fmt: skip
