"""GPT-2's byte-level alphabet: every byte as one printable character, the spelling byte-level
BPE tokenizers (GPT-2, Qwen, Llama 3) give their tokens."""

from __future__ import annotations

import functools


@functools.cache
def byte_to_char() -> tuple[str, ...]:
    """The printable character of each byte value 0-255 (printable ASCII and Latin-1 stand for
    themselves; the others are shifted past 255, in byte order)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}  # fmt: skip
    chars, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return tuple(chars)


@functools.cache
def char_to_byte() -> dict[str, int]:
    return {char: byte for byte, char in enumerate(byte_to_char())}
