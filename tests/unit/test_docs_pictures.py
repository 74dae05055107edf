"""Every picture under docs/ is shown by a doc, and every picture a doc shows is there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
PICTURE = re.compile(r"\.(png|jpe?g|svg|gif)$", re.IGNORECASE)
SHOWN = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)|<img [^>]*src=\"([^\"]+)\"")


def shown() -> dict[Path, list[Path]]:
    """Pictures the docs and the README show, by the document showing them."""
    found: dict[Path, list[Path]] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for match in SHOWN.finditer(doc.read_text()):
            target = match.group(1) or match.group(2)
            if not re.match(r"[a-z]+://", target):
                found.setdefault((doc.parent / target).resolve(), []).append(doc)
    return found


def test_every_picture_under_docs_is_shown_by_a_doc():
    pictures = {p.resolve() for p in (ROOT / "docs").rglob("*") if PICTURE.search(p.name)}
    assert pictures, "docs/ holds pictures: the check must see them"
    unshown = sorted(str(p.relative_to(ROOT)) for p in pictures - set(shown()))
    assert not unshown, f"pictures no doc shows (show them or remove them): {unshown}"


def test_every_picture_a_doc_shows_exists():
    missing = {str(p): [str(d.relative_to(ROOT)) for d in docs] for p, docs in shown().items() if not p.exists()}
    assert not missing, f"docs show pictures that are not there: {missing}"
