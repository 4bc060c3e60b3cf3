"""The web chat's files (deployments/openai/webchat/, deployments/openai/webchat_assets.py): the vendored
JavaScript libraries are pinned by exact version and locked with integrity hashes, shipped with
their licenses, unchanged since they were fetched (SHA256SUMS), and in the wheel; the page names
each file with its hash. No network, no browser: `python -m deployments.openai.webchat_assets check`
fetches the pinned versions again."""

import glob
import json
import re
import tomllib
from pathlib import Path

from deployments.openai.webchat_assets import (
    SERVED,
    VENDOR_DIR,
    VENDORED,
    WEBCHAT_DIR,
    WebChatFiles,
    file_sums,
    read_sums,
)

ROOT = Path(__file__).resolve().parent.parent


def test_libraries_are_pinned_exactly_and_locked_with_integrity_hashes():
    pins = json.loads((VENDOR_DIR / "package.json").read_text())["dependencies"]
    lock = json.loads((VENDOR_DIR / "package-lock.json").read_text())
    assert set(pins) == {package for package, _ in VENDORED.values()}
    assert lock["packages"][""]["dependencies"] == pins
    for package, version in pins.items():
        assert re.fullmatch(r"\d+\.\d+\.\d+", version), (package, version)  # no ranges
        entry = lock["packages"][f"node_modules/{package}"]
        assert entry["version"] == version and entry["integrity"].startswith("sha512-"), package


def test_vendored_files_are_the_fetched_ones_and_carry_their_licenses():
    sums = read_sums()
    assert set(sums) == set(VENDORED)
    assert file_sums(VENDOR_DIR, sorted(VENDORED)) == sums  # SHA256SUMS is written by `update` only
    licenses = {name: (VENDOR_DIR / name).read_text() for name in VENDORED if name.startswith("LICENSE")}
    assert {package for name, (package, _) in VENDORED.items() if name in licenses} == \
        {package for package, _ in VENDORED.values()}  # one license file per library
    for name, text in licenses.items():
        assert "copyright" in text.lower() and len(text) > 500, name


def test_the_wheel_carries_every_webchat_file():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["deployments.openai"]
    package = ROOT / "deployments" / "openai"
    shipped = {Path(p) for pattern in patterns for p in glob.glob(pattern, root_dir=package)}
    files = {p.relative_to(package) for p in WEBCHAT_DIR.rglob("*") if p.is_file()}
    assert files and files <= shipped, sorted(files - shipped)


def test_the_page_names_each_file_with_its_hash():
    files = WebChatFiles()
    page = files.page.decode()
    for name in SERVED:
        path = f"/webchat/{name}"
        assert f'"webchat/{name}?v={files.assets[path].version}"' in page, name
        assert files.cache_control(path, files.assets[path].version).endswith("immutable")
        assert files.cache_control(path, None) == "no-cache"
    # nothing inline: the Content-Security-Policy allows no inline script or style
    assert not re.search(r"<script>|<style|\son[a-z]+=|\sstyle=", page)
