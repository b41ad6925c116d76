"""Every relative link of README.md and of the pages under docs/ leads somewhere: to a file or folder of
the repository and, with a `#fragment` into a Markdown page, to one of that page's headings (GitHub's
anchors: the heading's text in lower case, punctuation dropped, spaces as hyphens, `-1`, `-2`, ... for a
repeat). Links inside fenced blocks and code spans are text, not links; web addresses are not followed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.readme_figures import REPO, doc_pages

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced blocks."""
    found, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        opening = _FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
        elif fence is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            fence = None
        elif fence is None:
            found.append((number, line))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before the -N of a repeat)."""
    text = _LINK.sub(lambda m: m.group(0)[m.group(0).index("[") + 1 : m.group(0).rindex("](")], heading)
    text = text.replace("`", "").lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown page."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(text):
        if match := _HEADING.match(line):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path, text: str) -> list[str]:
    """'PAGE:LINE: TARGET: why' for every relative link of a page that does not resolve."""
    problems = []
    for number, line in prose_lines(text):
        for match in _LINK.finditer(_CODE_SPAN.sub("", line)):
            target = match.group(1)
            if _SCHEME.match(target):
                continue
            where = f"{page.relative_to(REPO)}:{number}: {target}"
            path, _, fragment = target.partition("#")
            if not path:  # a heading of this page
                if fragment not in anchors(text):
                    problems.append(f"{where}: no heading with that anchor in {page.relative_to(REPO)}")
                continue
            resolved = (page.parent / path).resolve()
            if not resolved.is_relative_to(REPO):
                problems.append(f"{where}: leads out of the repository")
            elif not resolved.exists():
                problems.append(f"{where}: no such file")
            elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved.read_text()):
                problems.append(f"{where}: no heading with that anchor in {resolved.relative_to(REPO)}")
    return problems


PAGES = doc_pages()


def test_the_pages_have_links_to_check():
    links = [m for page in PAGES for _, line in prose_lines(page.read_text()) for m in _LINK.finditer(line)]
    assert len(links) >= 20


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page):
    assert not broken_links(page, page.read_text())


def test_a_link_that_leads_nowhere_is_named_with_its_page_and_line():
    page = REPO / "docs" / "x.md"
    text = (
        "# A `page`: its title\n\n## Two words\n\n## Two words\n\n"
        "[fine](data.md) [fine](#two-words) [fine](#two-words-1) [fine](#a-page-its-title) ![fine](timeline.png)\n"
        "[fine](../README.md#quick-start) [web](https://example.com/nope.md) `[code](nope.md)`\n"
        "```\n[in a block](nope.md)\n```\n"
        "[gone](nope.md) and [bad anchor](data.md#nope)\n"
        "[same page](#two-words-2) [out](../../etc/passwd)\n"
    )
    assert broken_links(page, text) == [
        "docs/x.md:12: nope.md: no such file",
        "docs/x.md:12: data.md#nope: no heading with that anchor in docs/data.md",
        "docs/x.md:13: #two-words-2: no heading with that anchor in docs/x.md",
        "docs/x.md:13: ../../etc/passwd: leads out of the repository",
    ]


def test_the_guides_index_links_every_page_under_docs():
    index = REPO / "docs" / "README.md"
    linked = {
        (index.parent / m.group(1).partition("#")[0]).resolve()
        for _, line in prose_lines(index.read_text())
        for m in _LINK.finditer(_CODE_SPAN.sub("", line))
        if not _SCHEME.match(m.group(1))
    }
    pages = {p.resolve() for p in PAGES if p.is_relative_to(index.parent) and p != index}
    assert pages - linked == set(), "docs/README.md links every page of the guide"
