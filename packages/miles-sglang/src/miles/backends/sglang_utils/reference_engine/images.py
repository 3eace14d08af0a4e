"""The images of a request (`image_data` on /generate, `image_url` parts on /v1/chat/completions),
read into RGB PIL images, each failure a 400 naming the image.

Three of SGLang's four sources are taken: `data:` URLs and raw base64 (decoded as miles' data side
writes them, `sglang_utils.image_data`) and local file paths. http(s) URLs are refused: fetching
would give every client the engine's network and stall the tokenizer thread that all requests
share; the client fetches and sends the bytes instead.
"""

from __future__ import annotations

import os
import re
import warnings

from PIL import Image

from miles.backends.sglang_utils.image_data import IMAGE_SUFFIXES, image_bytes, open_image
from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError

# A string that opens with a URL scheme (`http://`, `s3://`, `file://`): a location, not bytes.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Longer strings are never paths (Linux's PATH_MAX): skip the file-system look-up for base64.
_MAX_PATH_CHARS = 4096
_SOURCES = "a data: URL (data:image/png;base64,...), raw base64 or a local file path"


def load_image(value: str, param: str) -> Image.Image:
    """`value` (one entry of image_data, named `param` in errors) decoded as an RGB image."""
    if _SCHEME.match(value):
        scheme = value.split("://", 1)[0]
        raise InvalidRequestError(
            f"{param} is a {scheme}:// URL ({_shown(value)}); the reference engine does not fetch "
            f"images: send {_SOURCES}",
            param=param,
        )
    if not value.startswith("data:") and len(value) <= _MAX_PATH_CHARS and os.path.isfile(value):
        try:
            with open(value, "rb") as file:
                return _decode(file.read(), param)
        except OSError as err:
            raise InvalidRequestError(
                f"{param}: cannot read the file {value!r}: {err.strerror or err}", param=param
            ) from None
    if value.lower().endswith(IMAGE_SUFFIXES):
        raise InvalidRequestError(
            f"{param}: no file at {value!r} (a path is read on the engine's machine); send an "
            "existing path or the image's bytes as a data: URL or base64",
            param=param,
        )
    try:
        raw = image_bytes(value)
    except ValueError as err:
        also = "" if value.startswith("data:") else ", or a local file path"
        raise InvalidRequestError(f"{param}: {err}{also}", param=param) from None
    return _decode(raw, param)


def _decode(raw: bytes, param: str) -> Image.Image:
    try:
        with warnings.catch_warnings():
            # Pillow warns past its pixel bound and raises past twice it: both are refusals here.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return open_image(raw)
    except (ValueError, Image.DecompressionBombWarning, Image.DecompressionBombError) as err:
        raise InvalidRequestError(
            f"{param} cannot be decoded: {err}; send a PNG, JPEG, WebP, GIF or BMP file's bytes",
            param=param,
        ) from None


def _shown(value: str, limit: int = 60) -> str:
    return repr(value) if len(value) <= limit else repr(value[: limit - 3] + "...")
