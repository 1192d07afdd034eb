"""Whether a step replay saw the boundary check's event again (localize/replay/tiered/step.py).

A replay that names an op stands for the event only where it made the same values at the same boundary; one that
found only a deliberate infinity explains the event only where it made every kind the check saw.
"""

from __future__ import annotations

from nan_magic.records import Report, TensorStats

__all__ = ["kinds_unexplained", "same_counts"]


def kinds_unexplained(replayed: TensorStats | None, seen: Report) -> tuple[str, ...]:
    """The non-finite kinds the boundary saw that a replay's value there lacks (none where it was not measured)."""
    if replayed is None:
        return ()
    # Not counted (the deferred check's tensor, freed by then): None is a kind it saw, 0 one it did not.
    stats = seen.output_stats
    counts = (stats.nan, stats.posinf, stats.neginf) if stats is not None and None in (
        stats.nan, stats.posinf, stats.neginf) else (seen.nan, seen.posinf, seen.neginf)
    again = (replayed.nan, replayed.posinf, replayed.neginf)
    return tuple(kind for kind, was, now in zip(("nan", "+inf", "-inf"), counts, again) if was != 0 and now == 0)


def same_counts(replayed: TensorStats | None, seen: Report) -> bool:
    """Whether the replay saw the boundary's event again.

    A boundary the replay does not measure (a module's gradient) counts as seen; where the check has no counts (the
    deferred check, after the tensor was freed), a non-finite value at the boundary is enough.
    """
    if replayed is None:
        return True
    if not seen.nonfinite:
        return bool(replayed.nonfinite)
    if (replayed.nan, replayed.posinf, replayed.neginf) == (seen.nan, seen.posinf, seen.neginf):
        return True
    # Code between backward and the check may turn what the replay makes into NaN: clip_grad_norm_ multiplies
    # every gradient by max_norm / total norm, 0 where the total is inf (inf * 0 = NaN at the same elements, the
    # NaN the replay made staying NaN), NaN where the total is NaN (every element, finite ones too).
    nan, posinf, neginf = replayed.nan or 0, replayed.posinf or 0, replayed.neginf or 0
    turned_nan = (nan + posinf + neginf == seen.nonfinite and seen.nan >= nan and seen.posinf <= posinf
                  and seen.neginf <= neginf)
    return turned_nan or (seen.nan == seen.numel and replayed.nonfinite > 0)
