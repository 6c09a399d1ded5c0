"""README.md is the front door to docs/: every relative link in README.md and docs/*.md
reaches a file (and a heading, where it names one), and every docs page is linked from
README.md."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import REPO

# Pages other branches are writing: README links them already; while one is absent its
# links are let pass, and once it exists it is checked like any other. Empty this set when
# they have all merged.
PENDING: set[str] = set()

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")


def pages(repo: Path) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def links(text: str) -> list[str]:
    """The targets of the Markdown links and images of ``text``, outside code."""
    return LINK.findall(CODE.sub("", FENCE.sub("", text)))


def anchors(text: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, a repeated
    id numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def broken_links(repo: Path, pending: set[str] = frozenset()) -> list[str]:
    found = []
    for page in pages(repo):
        for target in links(page.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            rel = file.relative_to(repo).as_posix() if file.is_relative_to(repo) else str(file)
            if not file.exists():
                if rel not in pending:
                    found.append(f"{page.relative_to(repo)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in set(anchors(file.read_text())):
                found.append(f"{page.relative_to(repo)}: {target} (no such heading)")
    return found


def unlinked_pages(repo: Path) -> list[str]:
    readme = repo / "README.md"
    linked = {(repo / t.partition("#")[0]).resolve() for t in links(readme.read_text())}
    return [p.relative_to(repo).as_posix() for p in pages(repo)[1:] if p.resolve() not in linked]


def test_every_relative_link_resolves():
    assert broken_links(REPO, PENDING) == []


def test_readme_links_every_docs_page():
    assert unlinked_pages(REPO) == [], "link these from README.md's index"


def test_the_checks_find_a_broken_link_a_missing_heading_and_an_unlinked_page(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# R\n[a](docs/a.md) [b](docs/b.md#nope) ![img](docs/x.png) [web](https://x.org)\n"
        "`[code](docs/nothing.md)`\n```\n[fenced](docs/nothing.md)\n```\n[p](docs/p.md)\n")
    (tmp_path / "docs" / "a.md").write_text("# A\n## Two words, here\n[back](../README.md)\n")
    (tmp_path / "docs" / "b.md").write_text("# B\n[a](a.md#two-words-here) [gone](gone.md)\n")
    (tmp_path / "docs" / "c.md").write_text("# C\n")
    assert broken_links(tmp_path, {"docs/p.md"}) == [
        "README.md: docs/b.md#nope (no such heading)",
        "README.md: docs/x.png (no such file)",
        "docs/b.md: gone.md (no such file)",
    ]
    assert unlinked_pages(tmp_path) == ["docs/c.md"]
