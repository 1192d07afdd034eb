"""Dynamo's ``force_eager`` stance while the watch needs it, and the user's own stance as they left it.

The op tracer (``ops=True``) and the full watch's hooks cannot see inside a compiled graph, and under the tracer
(a dispatch mode) ``torch.compile(fullgraph=True)`` raises where dynamo compiled no frame: while such a watch is
on, compiled code runs eagerly (:func:`eager_stance`). The stance is process-wide and the user's: the watch never
leaves a trace on it.

* A stance the user set before the watch is theirs again, the very object, when the watch ends (returns, reports,
  raises, is interrupted). The user's own ``force_eager`` is left in place, untouched.
* A stance the user sets while the watch is on (``torch.compiler.set_stance("default")`` in the cell) is in
  effect from their call on, and is theirs after the watch: the watch does not give back the one from before it.
  Where the full watch then calls a compiled model it needs ``force_eager`` again (:meth:`EagerStance.again`): the
  compiled graph would hide the model's calls, compile the watch's hooks into a graph (a recompile, or
  ``fail_on_recompile``'s error on healthy code) and keep it after the watch. It is put back for that call and the
  rest of the watch, and the user's stance is theirs again when the watch ends. Under ``ops=True`` a compiled
  function (not a model) runs under the user's stance: dynamo skips its frames under the tracer (a dispatch mode),
  so it runs eagerly anyway, and a ``fullgraph=True`` one raises torch's "found no compiled frames" as it would
  under any dispatch mode of the user's.
* Watches left out of order (a nested one outliving its outer: ``%nanwatch on`` across cells) restore the stance
  from before the first of them, never a stance of an earlier watch's.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["EagerStance", "eager_stance"]

#: The stances of watches entered and not yet left that set one, innermost last.
_LIVE: list[EagerStance] = []
#: ``(the stances it set, before)`` of a watch left while a later watch's stance was on top: that one gives back
#: ``before`` when it is left.
_LEFT_UNDER: list[tuple[list[Any], Any]] = []


def _frame_stances() -> Any:
    """Dynamo's module holding the current stance and its setter, or None (torch<2.6, a torch without dynamo)."""
    try:
        from torch._dynamo import eval_frame
    except ImportError:  # pragma: no cover - torch without dynamo
        return None
    if not (hasattr(eval_frame, "_stance") and hasattr(eval_frame, "_set_stance")
            and hasattr(eval_frame, "DynamoStance")):
        return None
    return eval_frame


class EagerStance:
    """``force_eager`` from ``__enter__`` to ``__exit__``; the user's stance after (see the module docstring).

    :meth:`again` puts ``force_eager`` back where the user set a stance of their own since (a full watch's call of
    a compiled model): the stance ``__exit__`` gives back is then the one they set."""

    def __init__(self) -> None:
        self._frames = _frame_stances()
        self._fallback: Any = None
        self._mine: list[Any] = []  # the stances set by this one (a user's ``with`` may give an earlier one back)
        self._before_of: list[Any] = []  # what each of ``_mine`` replaced
        self._left = False

    def __enter__(self) -> EagerStance:
        frames = self._frames
        if frames is None:  # pragma: no cover - torch<2.6 (no stance), or a dynamo that keeps it elsewhere
            if hasattr(torch.compiler, "set_stance"):
                self._fallback = torch.compiler.set_stance("force_eager")
                self._fallback.__enter__()
            return self
        self.again()
        return self

    def again(self) -> None:
        """``force_eager`` again, where the stance is not one of ours (the user set theirs since)."""
        frames = self._frames
        if frames is None or self._left:  # (a call after the watch ended sets nothing)
            return
        now = frames._stance
        if self.owns(now) or (now.stance == "force_eager" and not any(live.owns(now) for live in _LIVE)):
            return  # ours already, or the user's own force_eager: theirs stays, untouched
        ours = frames.DynamoStance("force_eager")
        before = frames._set_stance(ours)
        if not self._mine:
            _LIVE.append(self)
        self._mine.append(ours)
        self._before_of.append(before)  # the stance from before the watch, or the one the user set in it since

    def owns(self, stance: Any) -> bool:
        return any(mine is stance for mine in self._mine)

    def __exit__(self, *exc: object) -> None:
        self._left = True
        if self._fallback is not None:  # pragma: no cover - (as in __enter__)
            self._fallback.__exit__(*exc)
            return
        if not self._mine:
            return
        frames = self._frames
        _LIVE.remove(self)
        now = frames._stance
        if self.owns(now):
            frames._set_stance(_unwound(self._before_of[[m is now for m in self._mine].index(True)]))
        elif any(live.owns(now) for live in _LIVE):
            for mine, before in zip(self._mine, self._before_of):
                _LEFT_UNDER.append(([mine], before))
        # Otherwise the user set a stance while the watch was on: theirs stays.
        self._mine, self._before_of = [], []
        if not _LIVE:
            _LEFT_UNDER.clear()  # (no watch left to give those back)


def eager_stance() -> EagerStance:
    """Compiled code runs eagerly until the block ends; the stance is then the user's (see the module docstring)."""
    return EagerStance()


def _unwound(stance: Any) -> Any:
    """``stance``, or, where it is a stance of a watch already left, the one that watch found (and so on)."""
    while True:
        left = next((pair for pair in _LEFT_UNDER if any(mine is stance for mine in pair[0])), None)
        if left is None:
            return stance
        _LEFT_UNDER.remove(left)
        stance = left[1]
