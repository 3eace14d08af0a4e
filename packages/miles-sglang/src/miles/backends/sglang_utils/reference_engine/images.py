"""The images of a request (`image_data` on /generate, `image_url` parts on /v1/chat/completions),
read into RGB PIL images, each failure a 400 naming the image.

Three of SGLang's four sources are taken: `data:` URLs, raw base64 and local file paths. http(s)
URLs are refused: fetching would give every client the engine's network and stall the
tokenizer thread that all requests share; the client fetches and sends the bytes instead.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import warnings

from PIL import Image, UnidentifiedImageError

from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError

# A string that opens with a URL scheme (`http://`, `s3://`, `file://`): a location, not bytes.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# SGLang reads a string with one of these endings as a file path; here a missing one is named so.
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")
# Longer strings are never paths (Linux's PATH_MAX): skip the file-system look-up for base64.
_MAX_PATH_CHARS = 4096
_SOURCES = "a data: URL (data:image/png;base64,...), raw base64 or a local file path"


def load_image(value: str, param: str) -> Image.Image:
    """`value` (one entry of image_data, named `param` in errors) decoded as an RGB image."""
    if value.startswith("data:"):
        return _decode(_data_url_bytes(value, param), param)
    if _SCHEME.match(value):
        scheme = value.split("://", 1)[0]
        raise InvalidRequestError(
            f"{param} is a {scheme}:// URL ({_shown(value)}); the reference engine does not fetch "
            f"images: send {_SOURCES}",
            param=param,
        )
    if len(value) <= _MAX_PATH_CHARS and os.path.isfile(value):
        try:
            with open(value, "rb") as file:
                return _decode(file.read(), param)
        except OSError as err:
            raise InvalidRequestError(
                f"{param}: cannot read the file {value!r}: {err.strerror or err}", param=param
            ) from None
    if value.lower().endswith(_IMAGE_SUFFIXES):
        raise InvalidRequestError(
            f"{param}: no file at {value!r} (a path is read on the engine's machine); send an "
            "existing path or the image's bytes as a data: URL or base64",
            param=param,
        )
    return _decode(_base64_bytes(value, param), param)


def _data_url_bytes(value: str, param: str) -> bytes:
    header, comma, payload = value.partition(",")
    if not comma or not header.endswith(";base64"):
        raise InvalidRequestError(
            f"{param} is a data: URL without base64 data ({_shown(value)}); send "
            "data:image/<format>;base64,<bytes>",
            param=param,
        )
    return _base64_bytes(payload, param)


def _base64_bytes(text: str, param: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise InvalidRequestError(
            f"{param} is not valid base64 ({err}; got {_shown(text)}); send {_SOURCES}",
            param=param,
        ) from None


def _decode(data: bytes, param: str) -> Image.Image:
    try:
        with warnings.catch_warnings():
            # Pillow warns past its pixel bound and raises past twice it: both are refusals here.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            image.load()  # decodes now: a truncated file fails here, not in the processor
        return image.convert("RGB")
    except Exception as err:  # Pillow raises several types for bad bytes
        why = (
            "no image format Pillow reads starts with these bytes"
            if isinstance(err, UnidentifiedImageError)
            else f"{type(err).__name__}: {err}"
        )
        raise InvalidRequestError(
            f"{param} ({len(data)} bytes) cannot be decoded as an image ({why}); send a PNG, "
            "JPEG, WebP, GIF or BMP file's bytes",
            param=param,
        ) from None


def _shown(value: str, limit: int = 60) -> str:
    return repr(value) if len(value) <= limit else repr(value[: limit - 3] + "...")
