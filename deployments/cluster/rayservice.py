"""Keep k8s/rayservice.yaml's `serveConfigV2` identical to serve_config.yaml.

The manifest embeds the serve config as a YAML block scalar (`serveConfigV2: |`). Rendering
replaces the block's text with the config file's, byte for byte (comments included), and leaves
the rest of the manifest as written; `lmserve render-k8s` runs it, a test checks it is a no-op.
"""

from __future__ import annotations

import re

_KEY = re.compile(r"^(?P<indent>[ ]*)serveConfigV2: \|[ ]*$")


class ManifestError(ValueError):
    """The manifest has no (or more than one) `serveConfigV2: |` block."""


def _block(lines: list[str]) -> tuple[int, int, int]:
    """(index of the key line, end of the block (exclusive), block indent) in `lines`."""
    keys = [i for i, line in enumerate(lines) if _KEY.match(line.rstrip("\n"))]
    if len(keys) != 1:
        raise ManifestError(f"expected one 'serveConfigV2: |' line, found {len(keys)}")
    start = keys[0]
    key_indent = len(_KEY.match(lines[start].rstrip("\n"))["indent"])
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip(" ")) > key_indent):
        end += 1
    while end > start + 1 and not lines[end - 1].strip():  # trailing blank lines are not the block's
        end -= 1
    return start, end, key_indent + 2


def embedded_serve_config(manifest: str) -> str:
    """The text of the manifest's `serveConfigV2` block, de-indented."""
    lines = manifest.splitlines(keepends=True)
    start, end, indent = _block(lines)
    return "".join(line[indent:] if line.strip() else "\n" for line in lines[start + 1:end])


def render_rayservice(manifest: str, serve_config: str) -> str:
    """`manifest` with its `serveConfigV2` block replaced by `serve_config` (indented).

    Raises:
        ManifestError: when the manifest does not have exactly one `serveConfigV2: |` block.
    """
    lines = manifest.splitlines(keepends=True)
    start, end, indent = _block(lines)
    body = [(" " * indent + line) if line.strip() else "\n" for line in serve_config.splitlines(keepends=True)]
    if body and not body[-1].endswith("\n"):
        body[-1] += "\n"
    return "".join(lines[:start + 1] + body + lines[end:])
