"""What a replay of a scene's producer found, in one line (``%nanreplay`` prints it).

A replay returns data (``ReplayResult``: the producer op it found, or a note
saying why none); the line is written here. The op is read through a
Protocol, so rendering knows nothing of the localizer that found it.
"""

from __future__ import annotations

from typing import Protocol

from nan_magic.locations import SourcePointer
from nan_magic.note_records import Note
from nan_magic.render.words.causes.phrases import counts_phrase

__all__ = ["replay_line"]


class FoundOp(Protocol):
    """What the line says of the op a replay found (``OpFinding``'s fields of those names)."""

    @property
    def op(self) -> str: ...

    @property
    def source(self) -> SourcePointer | None: ...

    @property
    def nan(self) -> int: ...

    @property
    def posinf(self) -> int: ...

    @property
    def neginf(self) -> int: ...


def replay_line(module: str | None, found: FoundOp | None, note: Note | None) -> str:
    """``replay of 1 reproduced 32 nan in aten.div.Tensor at model.py:12 in forward``, or why it found no op.

    ``module`` is the replayed module's qualified name (``""`` or None: the
    root); ``note`` is the replay's note where it found no op.
    """
    label = module or "the root module"
    if found is None:
        return note.text if note is not None else f"replay of {label} stayed finite"
    where = f" at {found.source}" if found.source is not None else ""
    return f"replay of {label} reproduced {counts_phrase(found.nan, found.posinf, found.neginf)} in {found.op}{where}"
