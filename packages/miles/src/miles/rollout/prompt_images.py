"""A prompt row's images (`--multimodal-keys`): read, checked and placed in its chat messages.

(architecture.md: "Contracts / Data", images)

A row's image column holds one image or a list of them, each a file path (relative to the data
file), a `data:` URL, base64 of the file, or, in Parquet written by `datasets`, a
`{"bytes": ..., "path": ...}` struct (or the image `datasets` decodes it to). Each is read and decoded here, at load, so a missing or
corrupt image names its `file:line` before any engine starts; from then on it travels as a `data:`
URL of the file's own bytes (`miles.backends.sglang_utils.image_data`). The chat template places
the image tokens: a message part `{"type": "image"}` per image, which rows that have none get at
the start of their first user message; the model's processor then expands each to its patches.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

from PIL import Image

from miles.backends.sglang_utils.image_data import (
    IMAGE_SUFFIXES,
    data_url,
    decode_image,
    image_bytes,
    open_image,
)

MEDIA_TYPES = ("image",)
"""The media `--multimodal-keys` may map to a column (upstream's spelling also knows "video",
which the engines here do not serve)."""
IMAGE_PART_TYPES = ("image", "image_url")
"""Chat message parts that stand for an image (transformers' and OpenAI's spellings)."""


def check_multimodal_keys(keys: dict[str, Any] | None) -> None:
    """Refuse a --multimodal-keys mapping this framework cannot honour, saying which part."""
    if keys is None:
        return
    if not keys:
        raise ValueError(
            '--multimodal-keys is an empty mapping; give e.g. \'{"image": "images"}\' or leave it '
            "unset for text-only data"
        )
    for media, column in keys.items():
        if media not in MEDIA_TYPES:
            raise ValueError(
                f"--multimodal-keys maps {media!r}, which is not supported; supported media: "
                f'{", ".join(MEDIA_TYPES)} (e.g. \'{{"image": "images"}}\')'
            )
        if not isinstance(column, str) or not column:
            raise ValueError(
                f"--multimodal-keys {media!r} must name a column of the data, got {column!r}"
            )


def row_images(where: str, value: Any, data_dir: Path) -> list[str]:
    """The images of one row as `data:` URLs; ValueError naming the row and the image for one
    that is missing, unreadable or not an image."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    images = []
    for number, item in enumerate(values, 1):
        label = f"{where}, image {number} of {len(values)}"
        raw, mime = _raw_image(label, item, data_dir)
        try:
            open_image(raw)
        except ValueError as err:
            raise ValueError(f"{label}: {err}; replace the image or remove the row") from None
        images.append(data_url(raw, mime=mime))
    return images


def processor_prompt_ids(processor: Any, text: str, images: list[str]) -> list[int]:
    """The token ids of a rendered prompt `text` with its `images` (`data:` URLs, in the order
    the text places them), as the model's processor makes them: each image's placeholder
    expanded to one token per merged patch."""
    pixels = [decode_image(image) for image in images]
    return list(processor(text=[text], images=pixels)["input_ids"][0])


def _raw_image(label: str, item: Any, data_dir: Path) -> tuple[bytes, str | None]:
    """The file bytes of one image value, and its type where the value says it."""
    if isinstance(item, dict) and ("bytes" in item or "path" in item):
        # `datasets`' Image feature in Parquet: the bytes, or a path when it kept none.
        if item.get("bytes"):
            return bytes(item["bytes"]), None
        item = item.get("path")
    if isinstance(item, bytes | bytearray):
        return bytes(item), None
    if isinstance(item, Image.Image):
        # `datasets` decodes the Image feature of a Parquet file it wrote: PNG keeps every pixel.
        buffer = io.BytesIO()
        item.save(buffer, format="PNG")
        return buffer.getvalue(), "image/png"
    if not isinstance(item, str) or not item:
        raise ValueError(
            f"{label} must be a file path, a data: URL or base64 of an image file, got "
            f"{type(item).__name__} {str(item)[:60]!r}"
        )
    if item.startswith("data:"):
        try:
            return image_bytes(item), item[5:].split(";", 1)[0] or None
        except ValueError as err:
            raise ValueError(f"{label}: {err}") from None
    path = Path(item) if Path(item).is_absolute() else data_dir / item
    if path.is_file():
        return path.read_bytes(), None
    if _looks_like_path(item):
        raise ValueError(
            f"{label}: no image file {item!r} (looked for {path}); paths are relative to the "
            "data file's directory"
        )
    try:
        return image_bytes(item), None
    except ValueError:
        raise ValueError(
            f"{label}: {item[:60]!r} is neither an image file (looked for {path}) nor base64 of one"
        ) from None


def _looks_like_path(item: str) -> bool:
    return ("/" in item[:200] and "." in item[-6:]) or Path(item).suffix.lower() in IMAGE_SUFFIXES


def place_images(where: str, messages: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """`messages` with exactly `count` image parts: kept where the row placed them (their number
    must match), else put at the start of the first user message."""
    placed = sum(
        1
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
    )
    if placed == count:
        return messages
    if placed:
        raise ValueError(
            f"{where}: the messages place {placed} image(s) but the row has {count}; give one "
            '{"type": "image"} part per image, or none to put them before the first user text'
        )
    user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if user is None:
        raise ValueError(f"{where}: the row has images but no user message to put them in")
    messages = copy.deepcopy(messages)
    content = messages[user]["content"]
    text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    messages[user]["content"] = [{"type": "image"} for _ in range(count)] + text
    return messages
