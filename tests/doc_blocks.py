"""The marked blocks of the docs that tests run: README.md and every page under docs/.

A marked block is the fenced block right after an HTML comment `<!-- KIND: NAME -->`
(`example: redis-py`, `walkthrough: three-nodes`, `identity-url: users`, ...): tests find a block
by its marker wherever it moved to, so a page can be reorganised without a test losing its example.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def doc_pages() -> list[Path]:
    """README.md first, then docs/ in path order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def doc_block(marker: str) -> tuple[Path, str]:
    """(the page, the block's text) of the one block marked `<!-- marker -->`."""
    pattern = re.compile(rf"<!-- {re.escape(marker)} -->\n```\w*\n(.*?)```", re.DOTALL)
    found = [(page, m[1]) for page in doc_pages() for m in pattern.finditer(page.read_text())]
    assert len(found) == 1, f"{len(found)} blocks marked {marker!r} in README.md and docs/ (expected one)"
    return found[0]
