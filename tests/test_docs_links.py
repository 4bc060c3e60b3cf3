"""Every relative link in README.md and docs/*.md resolves: the file exists, and a `#fragment`
names a heading of the target (GitHub's anchor rule). No model, no Ray."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) outside code; a target with a scheme (https:, mailto:) is not checked.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces to
    hyphens, `-1`, `-2` for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", path.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", path.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    broken = []
    for target in relative_links(doc):
        file_part, _, fragment = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_docs_refer_to_nothing_outside_the_repository():
    for doc in DOCS:
        text = doc.read_text()
        assert "DESIGN.md" not in text and "shared/" not in text, doc


def file_map_paths(text: str) -> set[str]:
    """The paths of docs/design.md's file map: a tree in a code block, two spaces per level, each
    line a file or folder (ending in /) and what it holds."""
    block = text[text.index("## File map"):].split("```\n")[1]
    paths, parents = set(), []
    for line in block.splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        parents[depth:] = [name.rstrip("/")]
        paths.add("/".join(parents))
    return paths


def test_the_file_map_names_every_module_and_only_files_that_exist():
    """docs/design.md's file map lists each module of deployments/ and engines/, in every
    subpackage (a newcomer finds every file there), and every path it names exists."""
    paths = file_map_paths((ROOT / "docs" / "design.md").read_text())
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/design.md's file map names files that do not exist: {missing}"
    modules = {str(p.relative_to(ROOT)) for package in ("deployments", "engines")
               for p in (ROOT / package).rglob("*") if p.suffix in (".py", ".html") and p.name != "__init__.py"
               and "webchat" not in p.parts and "__pycache__" not in p.parts}
    unlisted = sorted(modules - paths)
    assert not unlisted, f"docs/design.md's file map does not list: {unlisted}"
