"""README.md and docs/*.md describe the product as it is: they cite no internal notes, no
issue numbers and no commits, and narrate no work sessions (history lives in CHANGELOG.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT_DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: What a product page never contains, each with the pattern that finds it.
FORBIDDEN = {
    "a citation of the external design notes": re.compile(r"STORAGE\.md|§"),
    "a path into the shared notes": re.compile(r"\.\./shared"),
    "an issue reference": re.compile(r"\bissues?\s+#?\d+|(?<![\w/&])#\d+\b", re.IGNORECASE),
    # 7-40 hex digits with at least one letter and one digit: an abbreviated or full commit id
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
    "a dated work session": re.compile(r"session of 20|\(\d{4}-\d{2}-\d{2}, \w+ session\)"),
}


def offences(text: str) -> list[str]:
    """``"<what>: <match>"`` for every forbidden word in ``text``."""
    return [f"{what}: {m.group(0)!r}" for what, pattern in FORBIDDEN.items() for m in pattern.finditer(text)]


def test_the_forbidden_words_are_found_where_they_occur():
    planted = ("see STORAGE.md §7.7 and ../shared/notes; fixed in issue 12 (#12) on commit 1b55e32 "
               "in the second session of 2026-12-04")
    found = {line.split(":")[0] for line in offences(planted)}
    assert found == set(FORBIDDEN)


def test_ordinary_product_words_are_not_taken_for_forbidden_ones():
    text = ("--seed 1, 1,800,000 jobs, 100000 jobs, worker.md#database-outages, `#` and 16 hex "
            "digits, BLAKE2b-128, deadbeef, a session advisory lock, revision 0009")
    assert offences(text) == []


@pytest.mark.parametrize("path", PRODUCT_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_the_product_docs_cite_no_notes_issues_commits_or_sessions(path: Path):
    assert offences(path.read_text()) == []
