"""What a replay of a scene's producer found, in one line (``%nanreplay`` prints it); the words of the notes a
tiered replay of the failing step leaves (note_words.py holds every other note's).

A replay returns data (``ReplayResult``: the producer op it found, or a note
saying why none); the line is written here. The op is read through a
Protocol, so rendering knows nothing of the localizer that found it.
"""

from __future__ import annotations

from typing import Protocol

from nan_magic.locations import SourcePointer
from nan_magic.note_records import Note
from nan_magic.render.words.causes.phrases import counts_phrase

__all__ = ["STEP_REPLAY_TEMPLATES", "replay_line"]

#: The notes of the tiered watch's replay of the failing step (localize/replay/tiered/step.py), by kind.
STEP_REPLAY_TEMPLATES: dict[str, str] = {
    "step-replayed": "named by replaying step {step}'s model call under per-module and op-level checks; the replay "
                     "saw the same event",
    "not-reproduced": "the replay of this step did not reproduce the event ({reason}); this is what the step's "
                      "boundary check saw: re-run with mode=\"full\" (%%nantrace --full) to find the producer",
    "not-reproduced-inputs": "the replay of this step did not reproduce the event ({reason}); this is what the "
                             "step's boundary check saw: a replay starts from the values the write left, so watch "
                             "with ops=True (%%nantrace --ops), whose tracer sees the write as it runs",
    "not-reproduced-generator": "the replay of this step did not reproduce the event ({reason}); this is what the "
                                "step's boundary check saw: watch with ops=True (%%nantrace --ops), whose tracer "
                                "sees each op as it runs",
    "not-reproduced-unseen": "the replay of this step did not make it again ({reason}), and no check saw it: watch "
                             "with ops=True (%%nantrace --ops), whose tracer sees each op as it runs",
    "step-replay-finite": "the replay stayed finite",
    "generator-not-kept": "the forward drew from a torch.Generator whose state at the call was not kept (a global "
                          "or a closure's generator, or one passed by keyword), so the replay drew other numbers; "
                          "its state is kept from the model's next call on",
}


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
