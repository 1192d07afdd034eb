"""A report's note as data: its kind and the plain values it rests on (stdlib only, below the records).

The engine says what it found or could not do (a replay that stayed finite,
a scene part left out) as a :class:`Note`; its sentence is written by
``nan_magic.render.words.note_words``, which sits above, reached through the writer
``nan_magic/__init__.py`` installs (as a FixTrial's description is). Nothing
reads a sentence back: a note's facts are the data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Note", "install_writer"]


@dataclass(frozen=True)
class Note:
    """One note of a report: ``kind`` names the sentence render/words/note_words.py writes, ``facts`` fill it in.

    ``facts`` are ``(name, value)`` pairs of stdlib values (str, int, float,
    bool, None, tuples of them), so a scene stores a note as plain data. A
    note that says why something else failed holds that other note as a
    fact, as its :attr:`pair`.
    """

    kind: str
    facts: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, kind: str, **facts: Any) -> Note:
        """``Note.of("scene-saved", path=path, size=size)``."""
        return cls(kind, tuple(facts.items()))

    @classmethod
    def raised(cls, kind: str, error: BaseException, **facts: Any) -> Note:
        """A note that ``error`` was raised: its type's name and the first line of its message."""
        message = str(error)
        return cls.of(kind, **facts, error=type(error).__name__, message=message.splitlines()[0] if message else "")

    @classmethod
    def from_pair(cls, pair: tuple[str, tuple[tuple[str, Any], ...]]) -> Note:
        """The note a :attr:`pair` holds."""
        return cls(*pair)

    @property
    def pair(self) -> tuple[str, tuple[tuple[str, Any], ...]]:
        """The note as ``(kind, facts)``: a plain value, for a fact of another note."""
        return self.kind, self.facts

    def fact(self, name: str, default: Any = None) -> Any:
        """The value of the fact ``name``, or ``default`` where the note has none."""
        return next((value for key, value in self.facts if key == name), default)

    def adding(self, **facts: Any) -> Note:
        """This note with more facts (a hint to rerun with ``ops=True`` after a replay's reason)."""
        return Note(self.kind, (*self.facts, *facts.items()))

    @property
    def text(self) -> str:
        """The note's sentence (written by render/words/note_words.py)."""
        return _writer[0](self)


_writer: list[Callable[[Note], str]] = []


def install_writer(writer: Callable[[Note], str]) -> None:
    """Write every Note's sentence with ``writer`` (its :attr:`Note.text`)."""
    _writer[:] = [writer]
