"""An exception's chain, walked one way for every reader of a rank's failure (the kind of its
record, runtime/guard/record.py; an out-of-memory, oom.py; a failed build, build_failure.py)."""

from __future__ import annotations

from typing import Iterator


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then the exception it was raised from (`__cause__`) or while handling
    (`__context__`), and so on, each once: a chain can loop back on itself."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
