"""Rewrite the generated part of a docs page: the text between two marker comments."""

from __future__ import annotations


def replace_section(path: str, begin: str, end: str, md: str) -> None:
    """Put ``md`` between the ``begin`` and ``end`` markers of ``path``; the rest stays."""
    with open(path) as f:
        text = f.read()
    if begin not in text or end not in text:
        raise SystemExit(f"{path} lacks the {begin} / {end} markers")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w") as f:
        f.write(head + begin + "\n" + md + end + tail)
