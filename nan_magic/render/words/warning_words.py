"""The sentence of each early warning (records: :class:`~nan_magic.records.EarlyWarning`).

The watch keeps a warning's kind and the numbers it rests on
(hot/checks/early.py); the words, and how the numbers are shown, are here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nan_magic.note_records import Note
from nan_magic.plain import from_plain
from nan_magic.records import TensorRef, module_label
from nan_magic.render.words.counted import counted, noun
from nan_magic.render.words.names import tensor_label

__all__ = ["WARNING_WORDS"]


def _spike(label: str) -> Callable[[Note], str]:
    def words(note: Note) -> str:
        return (f"the {label} reached {note.fact('value'):.3g}, {note.fact('ratio'):.3g}x its running median: "
                "a learning rate too high, a bad batch, or a run starting to diverge")
    return words


def _scale_falling(note: Note) -> str:
    return (f"the GradScaler scale fell on each of the last {counted(note.fact('falls'), 'step')}, "
            f"to {note.fact('scale'):g}: "
            "scaled gradients keep overflowing; find the gradient that grows (the report's backward events)")


def _norm_overflow(note: Note) -> str:
    names: tuple[str, ...] = note.fact("parameters", ())
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"the gradient norm of {shown} overflowed float32 before the {note.fact('optimizer')} step although "
            "every element is finite: gradients are near the float32 limit; lower the learning rate or clip them")


def _batch_tensor(note: Note) -> str:
    """The label of the batch tensor a warning is about (``input[0]``)."""
    return tensor_label(from_plain(TensorRef, note.fact("tensor")))


def _subject(note: Note) -> str:
    return "the batch entering the model" if note.fact("tensor") is None else f"{_batch_tensor(note)} of the batch"


def _extreme_input(note: Note) -> str:
    return (f"{_subject(note)} holds |x| = {note.fact('absmax'):.3g} (> {note.fact('limit'):.0e}): normalise or "
            "clip the inputs before they overflow a layer")


def _constant_feature(note: Note) -> str:
    axis, count = note.fact("axis"), note.fact("count")
    constant: tuple[tuple[int, float], ...] = note.fact("constant", ())
    shown = ", ".join(f"{index} (= {value:.3g})" for index, value in constant)
    more = f" and {count - len(constant)} more" if count > len(constant) else ""
    return (f"{_batch_tensor(note)}: {count} of {counted(note.fact('features'), axis)} {noun(count, 'is', 'are')} "
            f"constant over the batch of "
            f"{counted(note.fact('rows'), 'row')}: {axis} {shown}{more}; standardising it divides by a zero std")


def _overflow_risk(note: Note) -> str:
    dtype, headroom, limit = note.fact("dtype"), note.fact("headroom"), note.fact("limit")
    return (f"{dtype} {note.fact('what')} of {module_label(note.fact('module'))} reached |x| = {limit / headroom:.3g}, "
            f"within {headroom:.2g}x of the {dtype} limit {limit:.5g}: compute it in float32 or scale it down")


def _repeated_events(note: Note) -> str:
    first, last = note.fact("first_step"), note.fact("last_step")
    steps = f"step {first}" if first == last else f"steps {first} to {last}"
    return (f"{counted(note.fact('events'), 'more non-finite event')} in {steps} met values already non-finite where "
            "an earlier warning had (a parameter, the loss, each step after the first event): warned of once each; "
            "the watch's events list holds them all")


#: Each warning kind's words, from its facts (a Note of the warning's kind and facts).
WARNING_WORDS: dict[str, Callable[[Note], str]] = {
    "loss-spike": _spike("loss"),
    "grad-norm-spike": _spike("gradient norm"),
    "scale-falling": _scale_falling,
    "grad-norm-overflow": _norm_overflow,
    "extreme-input": _extreme_input,
    "constant-feature": _constant_feature,
    "overflow-risk": _overflow_risk,
    "repeated-events": _repeated_events,
}


def warning_text(kind: str, facts: tuple[tuple[str, Any], ...]) -> str:
    """The sentence of a warning of ``kind`` resting on ``facts``; a kind this version does not know, its facts."""
    words = WARNING_WORDS.get(kind)
    if words is not None:
        try:
            return words(Note(kind, facts))
        except (TypeError, ValueError):  # facts of another version's shape (a scene): shown as they are
            pass
    return f"{kind}: " + ", ".join(f"{key} {value}" for key, value in facts)
