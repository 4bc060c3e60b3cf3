"""Images of chat requests: find `image_url` content parts, load them (data URLs always; remote
URLs and local files only where `MediaSettings` allows), decode them with PIL.

Mirrors vLLM's OpenAI server (`vllm/multimodal/media/connector.py`: data URLs always,
`file://` only under `--allowed-local-media-path`, a fetch timeout) and LLaMA-Factory's API
(`src/llamafactory/api/chat.py` takes data URLs, local paths and http URLs, unrestricted;
lmserve refuses the last two unless configured). `image_url.detail` is accepted and ignored, as
in both. Every failure is a `ServingError` (INVALID_REQUEST: HTTP 400, `param="messages"`) naming the
content part, never a 500 or a hang.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from engines.errors import ServingError


class MediaSettings(BaseSettings):
    """Where images may come from, and how much of them a request may bring.

    Defaults are safe for a public endpoint: only data URLs, at most `max_images_per_request`
    images of at most `max_image_bytes` bytes each and `max_image_pixels_per_request` pixels in
    all. A field not given when the object is built
    comes from its environment variable, `LMSERVE_` + its name in capitals (e.g.
    `LMSERVE_ALLOW_REMOTE_MEDIA=true`), else its default.

    Raises:
        pydantic.ValidationError: an unknown field, or a value (given or from the environment)
            that does not parse, naming it.
    """

    model_config = SettingsConfigDict(env_prefix="LMSERVE_", env_ignore_empty=True, extra="forbid")

    allow_remote_media: bool = Field(
        False, description="Fetch http(s) image URLs (the server then reaches any host a client names).")
    allowed_local_media_path: str | None = Field(
        None, description="Read images from `file://` URLs and absolute paths inside this directory only "
        "(vLLM's --allowed-local-media-path); unset: no local files.")
    media_fetch_timeout_s: float = Field(
        10, gt=0, description="Whole-fetch limit for one remote image (seconds).")
    max_image_bytes: int = Field(
        10 * 1024 * 1024, gt=0, description="Largest encoded image accepted (bytes).")
    max_images_per_request: int = Field(
        8, ge=1, description="Most images in one request (vLLM's --limit-mm-per-prompt).")
    max_image_pixels_per_request: int = Field(
        50_000_000, ge=1, description="Most pixels (width x height) of all images of one request together, "
        "read from the images' headers before any is decoded (a decoded pixel takes 3-4 bytes).")


@dataclass(frozen=True)
class ImagePart:
    """One `image_url` content part: where it is (`messages[i].content[j]`) and its URL."""

    where: str
    url: str


def image_parts(messages: list[dict[str, Any]]) -> list[ImagePart]:
    """The `image_url` parts of OpenAI chat messages, in prompt order.

    Raises:
        ServingError(INVALID_REQUEST): an `image_url` part without `image_url.url` (a string).
    """
    parts = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if part.get("type") != "image_url":
                continue
            where = f"messages[{i}].content[{j}]"
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else None
            if not isinstance(url, str) or not url:
                raise ServingError.invalid_request(f"{where}: an image_url part needs `image_url: {{\"url\": ...}}`",
                                                   param="messages")
            parts.append(ImagePart(where, url))
    return parts


def open_image(data: bytes, where: str) -> Any:
    """Encoded image bytes -> a `PIL.Image` whose header only is read (size and mode known, the
    pixels not decoded yet: `decode_image`).

    Raises:
        ServingError(INVALID_REQUEST): not an image PIL can read, or a decompression bomb (PIL's
            `MAX_IMAGE_PIXELS`).
    """
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise _undecodable(where, exc) from None


def decode_image(data: bytes | Any, where: str) -> Any:
    """Encoded image bytes, or an image from `open_image` -> a fully decoded `PIL.Image` (mode
    kept; see `fit_pixels`).

    Raises:
        ServingError(INVALID_REQUEST): as `open_image`, or pixel data that does not decode.
    """
    image = open_image(data, where) if isinstance(data, bytes) else data
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as exc:
        raise _undecodable(where, exc) from None
    return image


def _undecodable(where: str, exc: BaseException) -> ServingError:
    return ServingError.invalid_request(f"{where}: cannot decode the image: {type(exc).__name__}: {exc}",
                                        param="messages")


def fit_pixels(image: Any, max_pixels: int, min_pixels: int) -> Any:
    """Resize `image` (keeping its aspect ratio) so that width x height lies within
    [`min_pixels`, `max_pixels`], then convert it to RGB.

    LLaMA-Factory's `image_max_pixels`/`image_min_pixels` (`src/llamafactory/data/mm_plugin.py`,
    `_preprocess_image`), applied the same way before the model's processor.
    """
    for bound, too_far in ((max_pixels, lambda p: p > max_pixels), (min_pixels, lambda p: p < min_pixels)):
        pixels = image.width * image.height
        if too_far(pixels):
            factor = math.sqrt(bound / pixels)
            image = image.resize((max(1, int(image.width * factor)), max(1, int(image.height * factor))))
    return image if image.mode == "RGB" else image.convert("RGB")


class ImageLoader:
    """Loads the images of a request under `MediaSettings`.

    Args:
        settings: what is allowed (sources, sizes, count, fetch timeout).
    """

    def __init__(self, settings: MediaSettings | None = None):
        self.settings = settings or MediaSettings()

    async def load(self, parts: list[ImagePart]) -> list[Any]:
        """Fetch every part (remote ones concurrently), read the images' headers, and decode
        them only when their pixels together are within `max_image_pixels_per_request`;
        `PIL.Image`s in order. Decoding runs in a worker thread.

        Raises:
            ServingError(INVALID_REQUEST): too many images or pixels, a source that is not
                allowed, a fetch that fails, times out or is too large, or bytes that are not an
                image.
        """
        limit = self.settings.max_images_per_request
        if len(parts) > limit:
            raise ServingError.invalid_request(f"the request has {len(parts)} images; at most {limit} are allowed per "
                                               "request", param="messages")
        data = await asyncio.gather(*(self._fetch(part) for part in parts))
        return await asyncio.to_thread(self._decode_all, parts, data)

    def _decode_all(self, parts: list[ImagePart], data: list[bytes]) -> list[Any]:
        images = [open_image(d, part.where) for part, d in zip(parts, data)]
        pixels = sum(image.width * image.height for image in images)
        limit = self.settings.max_image_pixels_per_request
        if pixels > limit:
            sizes = ", ".join(f"{image.width}x{image.height}" for image in images)
            raise ServingError.invalid_request(
                f"the request's images have {pixels} pixels ({sizes}); at most {limit} are allowed per request "
                "(media.max_image_pixels_per_request)", param="messages")
        return [decode_image(image, part.where) for part, image in zip(parts, images)]

    async def _fetch(self, part: ImagePart) -> bytes:
        url = part.url
        if url.startswith("data:"):
            data = self._from_data_url(part)
        elif url.startswith(("http://", "https://")):
            data = await self._from_http(part)
        elif url.startswith(("file:", "/")):
            data = await asyncio.to_thread(self._from_file, part)
        else:
            raise ServingError.invalid_request(f"{part.where}: unsupported image URL {url[:60]!r}; use a data URL "
                                               "(data:image/png;base64,...)", param="messages")
        return data

    def _too_large(self, part: ImagePart, size: int) -> ServingError:
        return ServingError.invalid_request(
            f"{part.where}: the image is larger than {self.settings.max_image_bytes} bytes ({size})", param="messages")

    def _from_data_url(self, part: ImagePart) -> bytes:
        header, sep, payload = part.url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ServingError.invalid_request(f"{part.where}: a data URL must be base64 encoded "
                                               "(data:image/png;base64,...)", param="messages")
        if len(payload) * 3 // 4 > self.settings.max_image_bytes:
            raise self._too_large(part, len(payload) * 3 // 4)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ServingError.invalid_request(f"{part.where}: the data URL is not valid base64: {exc}",
                                               param="messages") from None

    async def _from_http(self, part: ImagePart) -> bytes:
        import httpx

        if not self.settings.allow_remote_media:
            raise ServingError.invalid_request(f"{part.where}: remote image URLs are not allowed on this server "
                                               "(media.allow_remote_media is off); send a data URL", param="messages")
        timeout = self.settings.media_fetch_timeout_s
        try:
            async with asyncio.timeout(timeout), httpx.AsyncClient(timeout=timeout, follow_redirects=True) as client:
                async with client.stream("GET", part.url) as response:
                    if response.status_code != 200:
                        raise ServingError.invalid_request(f"{part.where}: fetching the image failed: HTTP "
                                                           f"{response.status_code}", param="messages")
                    chunks, size = [], 0
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > self.settings.max_image_bytes:
                            raise self._too_large(part, size)
                        chunks.append(chunk)
                    return b"".join(chunks)
        except TimeoutError:
            raise ServingError.invalid_request(f"{part.where}: fetching the image took longer than {timeout:g} s",
                                               param="messages") from None
        except httpx.HTTPError as exc:
            raise ServingError.invalid_request(f"{part.where}: fetching the image failed: {type(exc).__name__}: {exc}",
                                               param="messages") from None

    def _from_file(self, part: ImagePart) -> bytes:
        root = self.settings.allowed_local_media_path
        if not root:
            raise ServingError.invalid_request(f"{part.where}: local image paths are not allowed on this server "
                                               "(media.allowed_local_media_path is not set); send a data URL",
                                               param="messages")
        raw = unquote(urlparse(part.url).path) if part.url.startswith("file:") else part.url
        path = Path(raw).resolve()  # symlinks and `..` resolved before the containment check
        if not path.is_relative_to(Path(root).resolve()):
            raise ServingError.invalid_request(f"{part.where}: {raw!r} is outside the allowed local media path",
                                               param="messages")
        try:
            size = path.stat().st_size
            if size > self.settings.max_image_bytes:
                raise self._too_large(part, size)
            return path.read_bytes()
        except OSError as exc:
            raise ServingError.invalid_request(f"{part.where}: cannot read {raw!r}: {exc.strerror}",
                                               param="messages") from None
