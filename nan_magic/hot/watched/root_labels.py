"""The label a model found by a discovering ``watch()`` joins under: the name the user's code calls it by.

Two models of one class (a GAN's ``G`` and ``D``, both ``nn.Sequential``; a teacher and a student) would both be
``Sequential``, and a report could not say which it means. The user's frame that called the model (the first
outside torch and nan_magic) is asked, once, as the model joins, for a name bound to it: ``G``, ``D``, as the
notebook's namespace names them for ``%%nantrace`` and a script's globals for the CLI. A helper's parameter
(``def step(net, x): return net(x)``) names every model it is given alike, so the name its caller binds is looked for
first (``step(G, x)``'s ``G``); a name another model joined under, rebound to this one (``model = Model()`` again in a
later cell), is numbered (``model#2``). A model the calling line takes from a container by constants
(``parts['decoder'](x)``, ``models[1](x)``) is named as written there (called_as.py), before any name bound to it (a
loop variable left over). Where no frame names the model (``nets[i](x)``, ``self.critic(x)``), its class names it,
numbered from the second model of that class on (``Sequential#2``): a label the watch already gave is never given
again. Only at a join: no cost a step.
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from types import FrameType

from torch import nn

from nan_magic.errors.frames import is_library_code
from nan_magic.hot.watched.called_as import called_as, let_go

__all__ = ["distinct_label", "name_in_callers"]

#: How many of the user's frames out from the call are asked for a name (a loop, a helper or two, the script).
FRAMES_ASKED = 8


def name_in_callers(module: nn.Module, taken: Collection[str | None]) -> str | None:
    """The name of ``module`` in the innermost of the user's calling frames that binds it to one not ``taken``
    (locals, then that frame's globals), or None. A function's parameter (``net`` of ``step(net, x)``) names whatever
    it is given: the name its caller binds the model to is looked for first, out to :data:`FRAMES_ASKED` frames.
    Names starting with ``_`` (IPython's ``_3``) and ``self`` are passed over."""
    frame: FrameType | None = sys._getframe(1)
    asked, parameter, rebound = 0, None, None
    while frame is not None and asked < FRAMES_ASKED:
        if not is_library_code(frame.f_code):
            asked += 1
            called, names = _bound_names(frame, module, calling=asked == 1)
            if called is not None:
                return distinct_label(called, taken)
            for name in names:
                if name in taken:
                    rebound = rebound or name
                elif name not in _parameters(frame):
                    return name
                else:
                    parameter = parameter or name
        frame = frame.f_back
    # A name an earlier model joined under, rebound to this one (``model = Model()`` in a later cell): numbered.
    return parameter or (distinct_label(rebound, taken) if rebound is not None else None)


def _bound_names(frame: FrameType, module: nn.Module, calling: bool) -> tuple[str | None, list[str]]:
    """How the frame names ``module``: as its call takes it from a container (``calling``: the frame calling it), and
    every name bound to it."""
    local = frame.f_locals
    called = called_as(module, frame, local) if calling else None
    names = [name for scope in (local, frame.f_globals) for name, value in list(scope.items())
             if value is module and not name.startswith("_") and name != "self"]
    held = sys.getrefcount(local)
    let_go(frame, local, held)
    return called, names


def _parameters(frame: FrameType) -> tuple[str, ...]:
    code = frame.f_code
    return code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]


def distinct_label(label: str, taken: Collection[str | None]) -> str:
    """``label``, or ``label#2``, ``label#3``... where a model already joined under it."""
    if label not in taken:
        return label
    number = 2
    while f"{label}#{number}" in taken:
        number += 1
    return f"{label}#{number}"
