"""The sentences of a trial that came out finite and is still not a fix (fixes/remedies/domain.py's ``frozen``,
fixes/remedies/diverged.py's ``diverged_before`` and ``still_diverged``).

Each reads its fact's values as given and says less where they are not what it expects: a report is never lost to a
sentence (a fact of a loss 0, a name that is not a string, a tuple of the wrong length).
"""

from __future__ import annotations

from typing import Any

from nan_magic.render.words.causes.phrases import fmt

__all__ = ["diverged_words", "frozen_words", "milliseconds"]

_LOWER = "(the learning rate is the run's to lower, as the cause says)"


def _number(value: Any) -> str:
    try:
        return fmt(float(value))
    except (TypeError, ValueError, OverflowError):
        return str(value)


def _finite_at(loss: Any) -> str:
    return "" if loss is None else f" (loss {_number(loss)})"


def frozen_words(names: Any, loss: Any, made: str, stepped: Any) -> str:
    """A clamp of a trained parameter (the ``names``) whose every value was out of the domain."""
    named = ", ".join(map(str, names)) if isinstance(names, (tuple, list)) else str(names)
    several = isinstance(names, (tuple, list)) and len(names) > 1
    return (f"not a fix, though the step came out finite{_finite_at(loss)}: the operand is the trained "
            f"parameter{'s' if several else ''} {named}: every value the line reads of it was clamped, so the clamp "
            f"passes it no gradient: it stays where it is and never trains (the {made} is hidden, not fixed)"
            f"{'' if stepped or stepped is None else ', no optimizer step replayed'}")


def diverged_words(before: Any, still: Any, loss: Any) -> str:
    """An ``lr`` trial from a state already diverged (``before``: step, its loss, the lowest's step, the lowest) or
    to a loss still diverged (``still``: the lowest's step, the lowest)."""
    head = f"not a fix, though the step came out finite{_finite_at(loss)}: "
    if isinstance(before, (tuple, list)) and len(before) == 4:
        at, was, low_step, low = before
        return (f"{head}the state it was redone from had already diverged (the loss at step {at} was "
                f"{_number(was)}, the lowest before it {_number(low)} at step {low_step}): lowering one update "
                f"cannot undo the ones before it {_LOWER}")
    if isinstance(still, (tuple, list)) and len(still) == 2:
        low_step, low = still
        return (f"{head}that loss is still far above the lowest before it, {_number(low)} at step {low_step}: at a "
                f"tenth of the learning rate, the update still diverges {_LOWER}")
    return f"{head}the run had diverged {_LOWER}"


def milliseconds(seconds: Any) -> str:
    try:
        return f"{float(seconds) * 1000:.0f}"
    except (TypeError, ValueError, OverflowError):
        return "?"


#: What each off-scale comparison of a trial (fixes/scale_check.py) is, as the verdict says it.
_OFF_SCALE = {"outputs": "the model's outputs where the step had gone non-finite reach {value}, where its finite "
                         "ones are at most {healthy}",
              "update": "it moves a parameter by {value}, where the parameters were at most {healthy} before it"}


def off_scale_words(off: tuple[tuple[str, float, float], ...], function: str | None, made: str, kind: str) -> str:
    """``but ... far off the healthy scale``: each comparison with its numbers (``off``: ``(what, value, healthy)``)."""
    said = []
    for what, value, healthy in off:
        if what == "op":
            said.append(f"the remedied {function or 'op'} gives {fmt(value)} where it was changed, where its other "
                        f"values are at most {fmt(healthy)}")
        else:
            said.append(_OFF_SCALE[what].format(value=fmt(value), healthy=fmt(healthy)))
    why = {"eps": "look at why the operand is out of the domain there",
           "lr": "a tenth is not enough: the rate is still far too high"}.get(kind, "look at why they are that large")
    return f"but {'; '.join(said)}: finite, yet far off the healthy scale (the {made} is moved, not fixed: {why})"
