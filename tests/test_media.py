"""Loading `image_url` content parts (engines/prompt/media.py): sources allowed only by configuration,
size, count and time limits, decoding; every failure a 400-class `ServingError` (INVALID_REQUEST)."""

import asyncio
import time

import pytest
from PIL import Image

from conftest import SLOW_IMAGE_DELAY_S, data_url, png_bytes
from deployments.openai.errors import http_status
from engines.errors import ServingError
from engines.prompt.media import ImageLoader, ImagePart, MediaSettings, fit_pixels, image_parts


def load(urls, **settings):
    loader = ImageLoader(MediaSettings(**settings))
    return asyncio.run(loader.load([ImagePart(f"messages[0].content[{i}]", u) for i, u in enumerate(urls)]))


def load_error(url: str | list[str], **settings) -> ServingError:
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request") as info:
        load(url if isinstance(url, list) else [url], **settings)
    assert info.value.param == "messages" and http_status(info.value.kind) == 400
    return info.value


def test_image_parts_in_prompt_order():
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "image_url", "image_url": {"url": "data:1", "detail": "low"}}]},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:2"}}]}]
    assert image_parts(messages) == [ImagePart("messages[1].content[1]", "data:1"),
                                     ImagePart("messages[2].content[0]", "data:2")]
    assert image_parts([{"role": "user", "content": "no images"}]) == []


@pytest.mark.parametrize("part", [{"type": "image_url"}, {"type": "image_url", "image_url": "data:..."},
                                  {"type": "image_url", "image_url": {"url": ""}}])
def test_image_part_without_url_is_refused(part):
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request", match=r"messages\[0\]\.content\[0\]"):
        image_parts([{"role": "user", "content": [part]}])


def test_data_url_is_decoded():
    (image,) = load([data_url(png_bytes((255, 0, 0), (40, 30)))])
    assert image.size == (40, 30) and image.convert("RGB").getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize("url,message", [
    ("data:image/png;base64,@@@not-base64@@@", "not valid base64"),
    ("data:image/png,rawbytes", "must be base64"),
    (data_url(b"definitely not a picture"), "cannot decode the image"),
    ("ftp://example.com/a.png", "unsupported image URL"),
    ("relative/a.png", "unsupported image URL"),
])
def test_bad_images_are_400(url, message):
    assert message in load_error(url).message


def test_too_large_data_url_is_refused_before_decoding():
    err = load_error(data_url(png_bytes((1, 2, 3), (400, 400))), max_image_bytes=100)
    assert "larger than 100 bytes" in err.message


def test_too_many_images():
    url = data_url(png_bytes((1, 2, 3)))
    assert len(load([url] * 3, max_images_per_request=3)) == 3
    assert "4 images; at most 3" in load_error([url] * 4, max_images_per_request=3).message


def test_remote_urls_refused_by_default_and_fetched_when_allowed(image_server):
    url = image_server + "/red.png"
    assert "remote image URLs are not allowed" in load_error(url).message
    (image,) = load([url], allow_remote_media=True)
    assert image.convert("RGB").getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize("path,message", [
    ("/missing.png", "HTTP 404"),
    ("/text.png", "cannot decode the image"),
    ("/big.png", "larger than 100000 bytes"),
])
def test_remote_failures_are_400(image_server, path, message):
    err = load_error(image_server + path, allow_remote_media=True, max_image_bytes=100_000)
    assert message in err.message


def test_remote_fetch_times_out(image_server):
    start = time.monotonic()
    err = load_error(image_server + "/slow.png", allow_remote_media=True, media_fetch_timeout_s=0.5)
    assert "longer than 0.5 s" in err.message
    assert time.monotonic() - start < SLOW_IMAGE_DELAY_S


def test_unreachable_host_is_400():
    err = load_error("http://127.0.0.1:9/a.png", allow_remote_media=True)
    assert "fetching the image failed" in err.message


def test_local_paths_only_inside_the_allowed_directory(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "red.png").write_bytes(png_bytes((255, 0, 0)))
    (tmp_path / "secret.png").write_bytes(png_bytes((0, 0, 0)))
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    inside = str(allowed / "red.png")
    assert "local image paths are not allowed" in load_error(inside).message
    for url in (inside, "file://" + inside):
        (image,) = load([url], allowed_local_media_path=str(allowed))
        assert image.convert("RGB").getpixel((0, 0)) == (255, 0, 0)
    for escape in (str(allowed / ".." / "secret.png"), str(allowed / "link.png"), "file:///etc/passwd"):
        err = load_error(escape, allowed_local_media_path=str(allowed))
        assert "outside the allowed local media path" in err.message
    assert "cannot read" in load_error(str(allowed / "none.png"), allowed_local_media_path=str(allowed)).message


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("LMSERVE_ALLOW_REMOTE_MEDIA", "true")
    monkeypatch.setenv("LMSERVE_MAX_IMAGES_PER_REQUEST", "2")
    settings = MediaSettings()
    assert settings.allow_remote_media and settings.max_images_per_request == 2
    assert MediaSettings(allow_remote_media=False).allow_remote_media is False


@pytest.mark.parametrize("size,expected", [
    ((2000, 1000), (1000, 500)),   # over max_pixels: scaled down, aspect kept
    ((10, 10), (31, 31)),          # under min_pixels: scaled up (int() rounds down, as in LF)
    ((100, 50), (100, 50)),        # within bounds: unchanged
])
def test_fit_pixels_mirrors_llamafactory(size, expected):
    image = fit_pixels(Image.new("L", size), max_pixels=1000 * 500, min_pixels=1000)
    assert image.size == expected and image.mode == "RGB"


def test_pixels_of_all_images_are_bounded_per_request_before_decoding(monkeypatch):
    """Eight images just within PIL's own bound would take gigabytes decoded: their pixels
    together are checked from their headers first, and none is decoded when they are too many."""
    import engines.prompt.media

    decoded = []
    decode = engines.prompt.media.decode_image
    monkeypatch.setattr(engines.prompt.media, "decode_image",
                        lambda image, where: decoded.append(where) or decode(image, where))
    url = data_url(png_bytes((1, 2, 3), (100, 50)))  # 5,000 pixels
    assert len(load([url] * 2, max_image_pixels_per_request=10_000)) == 2
    assert len(decoded) == 2
    decoded.clear()
    err = load_error([url] * 3, max_image_pixels_per_request=10_000)
    assert "15000 pixels (100x50, 100x50, 100x50); at most 10000" in err.message
    assert decoded == []
    assert MediaSettings().max_image_pixels_per_request == 50_000_000
