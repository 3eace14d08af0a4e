"""How one token is shown in OpenAI's log-probs: its text and its exact bytes.

Shared by every OpenAI-compatible answer miles writes (the reference engine's routes and the
agents' session server), so a token is spelled the same wherever it is shown.
"""

from __future__ import annotations

from typing import Any

from miles.backends.sglang_utils.byte_level import char_to_byte


class TokenSpelling:
    """A tokenizer's token texts and bytes, each computed once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._byte_values = _byte_level_values(tokenizer)

    def text(self, token_id: int) -> str:
        """One token's text as OpenAI's logprobs show it (special tokens included)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def bytes(self, token_id: int) -> bytes:
        """One token's bytes. A byte-level BPE token can be part of a character, whose text
        alone is U+FFFD: its bytes come from the token's own byte-level spelling."""
        if self._byte_values is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(char in self._byte_values for char in piece):
                return bytes(self._byte_values[char] for char in piece)
        return self.text(token_id).encode()

    def logprob_entry(
        self, token_id: int, logprob: float, top: list[tuple[float, int]] = ()
    ) -> dict[str, Any]:
        """One entry of a chat answer's `logprobs.content`: the token, its bytes, its log-prob
        and the `(logprob, token_id)` alternatives asked for."""
        return {
            "token": self.text(token_id),
            "bytes": list(self.bytes(token_id)),
            "logprob": logprob,
            "top_logprobs": [
                {"token": self.text(tid), "bytes": list(self.bytes(tid)), "logprob": lp}
                for lp, tid in top
            ],
        }


def _byte_level_values(tokenizer: Any) -> dict[str, int] | None:
    """The byte of each character of a byte-level tokenizer's alphabet; None for tokenizers that
    do not decode byte-level."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
        return None
    return char_to_byte()
