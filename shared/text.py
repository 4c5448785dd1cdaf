"""Small wordings every command's output shares: counted nouns, one-line reports."""

from __future__ import annotations


def plural(n: int, word: str, words: str | None = None) -> str:
    """``n`` and the noun that agrees with it: "1 dead letter", "1,204 batches"; ``words`` is
    the plural when adding "s" (or "es") is wrong."""
    if n == 1:
        return f"{n} {word}"
    if words is None:
        words = word + ("es" if word.endswith(("s", "x", "ch", "sh")) else "s")
    return f"{n:,} {words}"


def ratio(part: float, whole: float) -> float | None:
    """``part / whole`` to four places; None over a zero ``whole`` (nothing to report)."""
    return round(part / whole, 4) if whole else None


def percent(value: float | None) -> str:
    """``91.3%``, or ``-`` for a :func:`ratio` that has nothing under it yet."""
    return "-" if value is None else f"{value:.1%}"


def one_line(text: str) -> str:
    """``text`` with its lines joined, for one-line reports."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def exception_headline(exc: BaseException) -> str:
    """``Type: first line of the message`` (a third-party message can run to pages)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
