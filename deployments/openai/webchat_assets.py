"""The web chat's files (deployments/openai/webchat/): what the ingress serves at `/` and under
`/webchat/`, and the JavaScript libraries vendored from the npm registry.

The page is `index.html`, `chat.js` and `chat.css`, plus three libraries pinned by exact version
in `webchat/vendor/package.json` and `package-lock.json` (sha512 integrity of each tarball):
marked (markdown), DOMPurify (sanitizes the HTML marked writes) and highlight.js (code), shipped
inside the Python package with their licenses, so the page needs no network beyond this server.
`webchat/vendor/SHA256SUMS` records the vendored files (a test checks them). To re-fetch the
pinned versions (npm checks every tarball against the lock's integrity) and compare them with the
vendored files, or to copy them in after changing a pin (`npm install --package-lock-only
<pkg>@<version>` in webchat/vendor first):

    python -m deployments.openai.webchat_assets check
    python -m deployments.openai.webchat_assets update
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

WEBCHAT_DIR = Path(__file__).parent / "webchat"
VENDOR_DIR = WEBCHAT_DIR / "vendor"
SUMS_FILE = VENDOR_DIR / "SHA256SUMS"

# vendored file (in webchat/vendor/) -> (npm package, path inside the package)
VENDORED: dict[str, tuple[str, str]] = {
    "marked.umd.js": ("marked", "lib/marked.umd.js"),
    "purify.min.js": ("dompurify", "dist/purify.min.js"),
    "highlight.min.js": ("@highlightjs/cdn-assets", "highlight.min.js"),
    "github.min.css": ("@highlightjs/cdn-assets", "styles/github.min.css"),
    "github-dark.min.css": ("@highlightjs/cdn-assets", "styles/github-dark.min.css"),
    "LICENSE.marked": ("marked", "LICENSE"),
    "LICENSE.dompurify": ("dompurify", "LICENSE"),
    "LICENSE.highlightjs": ("@highlightjs/cdn-assets", "LICENSE"),
}

# what the ingress serves below `/webchat/` (public, like the page): the page's own files, then
# the vendored ones; the licenses as text
SERVED = ("chat.js", "chat.css", *(f"vendor/{name}" for name in VENDORED))
CONTENT_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
                 ".html": "text/html; charset=utf-8"}

# The page loads from this server only and runs no inline script: even an answer that got past
# DOMPurify could neither run code nor reach another host.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"content-security-policy": CONTENT_SECURITY_POLICY, "x-content-type-options": "nosniff",
                "referrer-policy": "no-referrer", "cache-control": "no-cache"}


@dataclass(frozen=True)
class Asset:
    """One file the ingress serves: its bytes, content type and a short hash of the bytes
    (the `v` query parameter the page adds to its URL, so a browser may cache it for good)."""

    body: bytes
    content_type: str
    version: str


class WebChatFiles:
    """The page and its assets, read once (per ingress replica).

    Attributes:
        assets: URL path below the app (`/webchat/chat.js`, ...) -> `Asset`.
        page: `index.html` with `?v=<hash>` added to each asset URL it names.
    """

    def __init__(self, directory: Path = WEBCHAT_DIR):
        self.assets: dict[str, Asset] = {}
        for name in SERVED:
            body = (directory / name).read_bytes()
            content_type = CONTENT_TYPES.get(Path(name).suffix, "text/plain; charset=utf-8")
            self.assets[f"/webchat/{name}"] = Asset(body, content_type, hashlib.sha256(body).hexdigest()[:12])
        page = (directory / "index.html").read_text()
        for path, asset in self.assets.items():
            page = page.replace(f'"{path[1:]}"', f'"{path[1:]}?v={asset.version}"')
        self.page = page.encode()

    def cache_control(self, path: str, version: str | None) -> str:
        """An asset asked for under its current `v` never changes: cached for a year;
        anything else is checked again each time."""
        return "public, max-age=31536000, immutable" if version == self.assets[path].version else "no-cache"


def file_sums(directory: Path, names: list[str]) -> dict[str, str]:
    """name -> sha256 hex digest of `directory / name`."""
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in names}


def read_sums(path: Path = SUMS_FILE) -> dict[str, str]:
    """The `sha256sum` file at `path` as name -> digest."""
    sums = {}
    for line in path.read_text().splitlines():
        digest, _, name = line.partition("  ")
        sums[name] = digest
    return sums


def fetch_pinned(workdir: Path) -> Path:
    """`npm ci` of webchat/vendor's package.json and package-lock.json in `workdir`: the exact
    pinned versions, each tarball checked by npm against the lock's integrity hash, no install
    scripts run. Returns the `node_modules` directory.

    Raises:
        FileNotFoundError: npm is not installed.
        subprocess.CalledProcessError: npm failed (no registry, an integrity mismatch).
    """
    for name in ("package.json", "package-lock.json"):
        shutil.copy(VENDOR_DIR / name, workdir / name)
    subprocess.run(["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=workdir, check=True)
    return workdir / "node_modules"


def main(argv: list[str] | None = None) -> int:
    """`check`: exit status 1 when a vendored file differs from the pinned package's;
    `update`: copy the pinned packages' files in and rewrite SHA256SUMS."""
    parser = argparse.ArgumentParser(prog="python -m deployments.openai.webchat_assets",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["check", "update"])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lmserve-webchat-") as tmp:
        modules = fetch_pinned(Path(tmp))
        fetched = {name: hashlib.sha256((modules / package / path).read_bytes()).hexdigest()
                   for name, (package, path) in VENDORED.items()}
        if args.action == "update":
            for name, (package, path) in VENDORED.items():
                shutil.copy(modules / package / path, VENDOR_DIR / name)
            SUMS_FILE.write_text("".join(f"{digest}  {name}\n" for name, digest in sorted(fetched.items())))
            print(f"updated {len(fetched)} files in {VENDOR_DIR}")
            return 0
    vendored = file_sums(VENDOR_DIR, list(VENDORED))
    differ = [name for name in VENDORED if vendored[name] != fetched[name]]
    for name in differ:
        package, path = VENDORED[name]
        print(f"{name} differs from {package}/{path} of the pinned version", file=sys.stderr)
    if not differ:
        print(f"{len(VENDORED)} vendored files match the pinned packages")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
