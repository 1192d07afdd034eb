"""The words of a non-finite learning rate: its notes (where it was set) and its cause's readings.

A NaN or infinite rate is no rate too high (``learning-rate-too-high`` is a finite rate whose updates overflow):
its cause is the number itself (``nonfinite-number``), and its fix is where that number was made, a scheduler's
step or the loop's line, never a lower rate (a tenth of NaN is NaN).
"""

from __future__ import annotations

from collections.abc import Callable

from nan_magic.note_records import Note
from nan_magic.render.words.causes.phrases import fmt

__all__ = ["LR_NOTE_TEMPLATES", "LR_NOTE_WRITERS", "scheduler_words"]

#: The notes of where a step's non-finite learning rate came from, filled from their facts.
LR_NOTE_TEMPLATES: dict[str, str] = {
    # localize/outside/loop_writes.py: a step's non-finite learning rate, made by the loop's code
    "lr-made-by-loop": "the learning rate lr = {lr} was set by the loop from a tensor its code computed: "
                       "{op} at line {line} made it, before the step read it (not a rate too high)",
    # localize/outside/lr_lines.py: a step's non-finite learning rate, set by the loop's line (no op made it)
    "lr-set-by-loop": "the learning rate lr = {lr} comes from {name}, which the loop set at line {line} before the "
                      "step read it (not a rate too high)",
    # localize/outside/lr_lines.py: no name holds it; the loop's one line that writes a group's "lr"
    "lr-stored-by-loop": "the loop's code has one line that writes a group's \"lr\", line {line}: where to look "
                         "for the learning rate lr = {lr} (no name holds it; whether that line ran is not known)",
    # fixes/no_remedy.py: no trial for a rate that is not a number (a tenth of NaN is NaN)
    "fixes-lr-nonfinite": "no fix was tried: the learning rate is {lr}, and a lower one (a tenth of it) is {lr} too; "
                          "the remedy is a finite rate where it is set, which no replay can choose",
}


def scheduler_words(scheduler: str | None, last_epoch: int | None, initial_lr: float | None) -> str:
    """``the LambdaLR scheduler's step (last_epoch 3; initial_lr 0.1)``, or, where only a group's ``initial_lr``
    told that a scheduler drives the optimizer, ``a learning-rate scheduler (... initial_lr 0.1)``."""
    who = f"the {scheduler} scheduler's step" if scheduler else "a learning-rate scheduler's step (none was found " \
        "by name; the group carries a scheduler's initial_lr)"
    known = [f"last_epoch {last_epoch}"] if last_epoch is not None else []
    known += [f"initial_lr {fmt(initial_lr)}"] if initial_lr is not None else []
    told = "; ".join(known)
    return f"{who} ({told})" if told else who


def _set_by_scheduler(note: Note) -> str:
    return (f"the learning rate lr = {fmt(note.fact('lr'))} was written by "
            f"{scheduler_words(note.fact('scheduler'), note.fact('last_epoch'), note.fact('initial_lr'))} "
            "(not a rate too high)")


#: The notes whose words depend on their facts.
LR_NOTE_WRITERS: dict[str, Callable[[Note], str]] = {"lr-set-by-scheduler": _set_by_scheduler}
