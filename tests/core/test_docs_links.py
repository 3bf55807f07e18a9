"""The docs point only at what the repository has: every relative markdown link in README.md
and docs/*.md resolves to a file (and, with a #fragment into a markdown page, to one of its
headings), every repository path named in backticks exists, and README.md stays a short
front page that opens with the two commands."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150
# Top-level folders a backticked path may start with; a path under one of them must exist.
REPO_DIRS = ("jetsplit", "server", "edge_agent", "export", "benchmarks", "scripts", "systemd",
             "profiles", "tests", "docs", "mutation", ".ci")

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code (where a link is not a link)."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    return _LINK.findall(_prose(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target}: no such heading")
    return bad


def _repo_file_names() -> set[str]:
    names = set()
    for _dir, subdirs, files in os.walk(ROOT):
        subdirs[:] = [d for d in subdirs if not d.startswith(".") and d not in ("runs",
                                                                               "__pycache__")]
        names.update(files)
    return names


def missing_paths(page: Path) -> list[str]:
    """Repository paths a page names that the repository lacks: a backticked path under one
    of REPO_DIRS, and anywhere a text file (`*.txt`) or an upper-case top-level page
    (`DESIGN.md`) that no file of the repository is called."""
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    bad = []
    for span in re.findall(r"`([^`\n]+)`", text):
        token = span.split("::")[0].strip()
        if not re.fullmatch(r"[\w.\-/]+", token) or "/" not in token:
            continue
        if token.split("/")[0] in REPO_DIRS and not (ROOT / token).exists():
            bad.append(token)
    names = _repo_file_names()
    for token in re.findall(r"[\w./-]*\.txt\b|\b[A-Z][A-Z0-9_-]+\.md\b", text):
        if Path(token).name not in names and token not in bad:
            bad.append(token)
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_repository_paths_named_exist(page: Path) -> None:
    assert missing_paths(page) == []


def test_readme_is_short_and_opens_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    first_block = _FENCE.search(text)
    assert first_block is not None, "README.md has no code block"
    block = first_block.group(0)
    assert "make demo" in block and "make test" in block
    assert block.index("make demo") < block.index("make test")


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """Broken links, missing headings and missing repository files are all reported."""
    (tmp_path / "there.md").write_text("# A heading (`x`)\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[a](missing.md) [b](there.md#nope) [c](there.md#a-heading-x) "
                    "[d](https://example.org/x.md) `[e](missing2.md)`\n"
                    "```\n[f](missing3.md)\n```\n`server/no_such_module.py` `server/`\n"
                    "see papers/gapsl.txt §3, DESIGN.md and README.md\n",
                    encoding="utf-8")
    assert broken_links(page) == ["missing.md: no such file", "there.md#nope: no such heading"]
    assert missing_paths(page) == ["server/no_such_module.py", "papers/gapsl.txt", "DESIGN.md"]
