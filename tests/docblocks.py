"""Fenced code blocks of the repository's Markdown, found by the HTML comment above them.

``<!-- runnable -->`` marks a Python example that runs as it is against a fresh database
(``tests/test_readme.py``); ``<!-- host: NAME -->`` marks a piece of the host-application
recipe (``tests/test_host_app.py``), which the tests use exactly as written.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["README", "blocks", "host_recipe", "runnable_blocks"]

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

_BLOCK = re.compile(r"<!--\s*(?P<marker>[^>]*?)\s*-->\s*\n```(?P<lang>[\w.-]*)\n(?P<body>.*?)\n```",
                    re.DOTALL)


def blocks(path: Path = README) -> list[tuple[str, str, str]]:
    """``(marker, language, body)`` of every fenced block directly under an HTML comment."""
    return [(m["marker"], m["lang"], m["body"]) for m in _BLOCK.finditer(path.read_text())]


def runnable_blocks(path: Path = README) -> list[str]:
    """The Python blocks marked ``<!-- runnable -->``, in document order."""
    return [body for marker, lang, body in blocks(path) if marker == "runnable" and lang == "python"]


def host_recipe(path: Path = README) -> dict[str, str]:
    """The blocks marked ``<!-- host: NAME -->``, by NAME."""
    out: dict[str, str] = {}
    for marker, _, body in blocks(path):
        if marker.startswith("host:"):
            out[marker.removeprefix("host:").strip()] = body
    return out
