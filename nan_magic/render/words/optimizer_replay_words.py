"""What a replay of an optimizer step (localize/replay/optimizer.py) says it ran on, and whose numbers it shows.

The replay steps again from what the step left: the parameter (or a copy kept before the step), its state as the
step advanced it and a gradient. Its op's operands, which the report's inputs and histograms show, are then the
replay's numbers; they are the step's own only where the replay started from a copy taken before the step and the
optimizer keeps no state. A deferred check judges the step after the next backward has replaced its gradient
(``gradient_step``: the step whose gradient the replay applied), and the note says so.
"""

from __future__ import annotations

from nan_magic.note_records import Note
from nan_magic.records import Report

__all__ = ["debug_later_step", "optimizer_replay_finite", "optimizer_replayed", "replayed_inputs"]

_KEPT = "a copy of the parameter kept before it (its values were near the limit of its dtype)"


def optimizer_replay_finite(note: Note) -> str:
    start = "from the parameter as it was before it" if note.fact("before") else "from the state it left"
    later = f", with step {note.fact('gradient_step')}'s gradient," if note.fact("gradient_step") is not None else ""
    return (f"a replay of the {note.fact('optimizer')} step {start}{later} stayed finite where the step made "
            "non-finite values: its op is not named")


def optimizer_replayed(note: Note) -> str:
    step, later, before = note.fact("step"), note.fact("gradient_step"), note.fact("before")
    if later is None:
        on = f"on {_KEPT}, its gradient and its state" if before else (
            "on copies of the parameter, its gradient and its state as the step left them (non-finite elements as 0)")
        whose = "" if note.fact("own_numbers") else "the step's own"
    else:
        on = (f"on {_KEPT} and its state" if before else f"on copies of the parameter and its state as step {step} "
              f"left them") + f" and of step {later}'s gradient (step {step}'s was replaced before it was judged)"
        whose = f"step {step}'s"
    numbers = f": its inputs and histograms are the replay's numbers, not {whose}" if whose else ""
    return f"{note.fact('op')} named by a replay of the {note.fact('optimizer')} step {on}{numbers}"


def replayed_inputs(report: Report) -> str:
    """Said after the inputs' verdict where they are an optimizer replay's numbers, not the step's: their "self
    (before)" row (the step's result, its non-finite elements as 0: [-1.8e38, 2.4e38] under an lr of 1e38) read as
    the weights before the step, the note that said otherwise many lines below."""
    replayed = next((note for note in report.note_facts if note.kind == "optimizer-replayed"), None)
    if replayed is None or (replayed.fact("gradient_step") is None and replayed.fact("own_numbers")):
        return ""
    return " (numbers of a replay of the optimizer step, not the step's own: see its note)"


def debug_later_step(note: Note) -> str:
    """Where %debug opens for a step judged at the next step's deferred check, and whose locals it shows."""
    judged, step = note.fact("judged"), note.fact("step")
    said = (f"judged at step {judged}'s deferred check: %debug opens the loop at this line in step {judged}, so its "
            f"locals (the batch, the loss) are step {judged}'s, not step {step}'s")
    if note.fact("other_call"):
        said += ", and those of this line's step() call for another optimizer (its loss, not this optimizer's)"
    return said
