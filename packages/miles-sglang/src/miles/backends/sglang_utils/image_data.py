"""Images as SGLang's `image_data` carries them: one string per image, a `data:` URL or raw base64.

miles keeps every image of a sample in this form from the data file to the engine and the trainer:
a string crosses Ray, HTTP and JSON unchanged, the bytes are the file's own (no re-encoding, so
the engine and the trainer decode the very same pixels), and equal strings mean equal images.
"""

from __future__ import annotations

import base64
import binascii
import io
import mimetypes

from PIL import Image, UnidentifiedImageError

_DATA_URL = "data:"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")
"""File endings that mark a string as an image file's path rather than its bytes (as SGLang reads
`image_data`): a missing file with one is named as such."""


def data_url(raw: bytes, *, mime: str | None = None) -> str:
    """`raw` (an image file's bytes) as a `data:` URL; the type is read from the bytes when not
    given."""
    if mime is None:
        mime = _mime_of(raw)
    return f"{_DATA_URL}{mime};base64,{base64.b64encode(raw).decode('ascii')}"


def image_bytes(value: str) -> bytes:
    """The file bytes of one `image_data` string: a `data:...;base64,` URL or raw base64.

    Raises ValueError saying which form was expected when `value` is neither."""
    payload = value
    if value.startswith(_DATA_URL):
        header, sep, payload = value.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ValueError(
                f"image data {_preview(value)} is a data: URL without ';base64,'; give the image "
                "as data:<type>;base64,<bytes>"
            )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(
            f"image data {_preview(value)} is neither a data: URL nor base64; give each image as "
            "data:image/png;base64,... or as base64 of the file"
        ) from None


def decode_image(value: str) -> Image.Image:
    """The RGB image of one `image_data` string, fully decoded (a truncated or corrupt file
    raises ValueError here, not in the middle of a forward)."""
    return open_image(image_bytes(value))


def open_image(raw: bytes) -> Image.Image:
    """`raw` decoded to RGB; ValueError naming what is wrong with bytes that are no image."""
    try:
        with Image.open(io.BytesIO(raw)) as image:
            image.load()
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        # PIL reports truncated files as OSError and some corrupt headers as SyntaxError.
        raise ValueError(f"{len(raw)} bytes that do not decode as an image ({err})") from None


def _mime_of(raw: bytes) -> str:
    try:
        with Image.open(io.BytesIO(raw)) as image:
            kind = image.format
    except (UnidentifiedImageError, OSError, SyntaxError):
        kind = None
    if kind is None:
        return "application/octet-stream"
    return mimetypes.types_map.get(f".{kind.lower()}", f"image/{kind.lower()}")


def _preview(value: str) -> str:
    return repr(value[:40] + ("..." if len(value) > 40 else ""))
