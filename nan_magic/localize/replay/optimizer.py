"""The op inside an optimizer step that made a parameter or its state non-finite: the step replayed on copies.

The tiered watch learns that a step went wrong from the step's result (the
parameters and half-precision state after it, step_checks.py), not from its ops:
tracing every step's ops is what ``ops=True`` pays for. At such an event the
step is run again under the op tracer, as ops mode would have traced it, on
copies of the offending parameter, its gradient and its state, by a replica of
the optimizer (its class, the parameter's group and its hyperparameters, the
step function without the watch's hooks): the real parameter, gradient and
state are never touched.

The step wrote its inputs in place, and keeping a copy of them before every
step would cost every healthy step a pass over the model. So the replay starts
from what the step left: the parameter and state as they are now, their
non-finite elements set to 0 (a stand-in for the finite values they held), and
the gradient the step applied (or, for the deferred check, the one in place
when the step was judged, its non-finite elements set to 0 too: a later
backward's). The same faults make the same elements non-finite again from
there (an ``eps`` that rounds to 0 divides 0 by 0 where the
gradient is 0, a NaN or huge learning rate spoils every update): the op is
named only when the replay makes every element the step made non-finite
non-finite again, and the report says the replay started from the state after
the step. A half-precision parameter that an ordinary update pushes past its
limit (``p.add_(update)`` past 65504 in float16) would stay finite from 0: such
a parameter, once its values came near the limit, is copied before each step
(hot/checks/optimizer/headroom.py), and the replay starts from that copy. The line is the
user's that called the step (``opt.step()``), or the op's own where the optimizer
is the user's code (a hand-written LARS's trust ratio).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections import defaultdict
from typing import Any

import torch

from nan_magic.errors.frames import is_library_file
from nan_magic.hot.kept.finding import Finding
from nan_magic.localize.ops.origins import OpFinding, attach_origin
from nan_magic.localize.ops.tracer import OpTracer
from nan_magic.records import Note, Phase, SourcePointer

__all__ = ["name_optimizer_op"]


def name_optimizer_op(
    finding: Finding,
    opt: torch.optim.Optimizer,
    parameter: torch.Tensor,
    key: str | None,
    caller: SourcePointer | None,
    before: torch.Tensor | None = None,
    *,
    kinds: frozenset[str],
) -> None:
    """Add to ``finding`` the op of ``opt``'s step that made ``parameter`` (or its state ``key``) non-finite.

    ``caller`` is the user's line that called the step; it becomes the
    report's line. ``before``: a copy of the parameter taken before the
    step (hot/checks/optimizer/headroom.py), which the replay then starts from. Where the
    replay does not make the same elements non-finite again, the finding
    keeps no op and says so.
    """
    bad = parameter if key is None else opt.state.get(parameter, {}).get(key)
    if not isinstance(bad, torch.Tensor):
        return
    try:
        replayed, origin, stateful = _replay(opt, parameter, key, kinds, before)
    except Exception:  # any optimizer (a closure it needs, a custom class): the event stands
        finding.notes.append(Note.of("optimizer-unreplayable", optimizer=type(opt).__name__))
        return
    with torch.no_grad():
        # Every element the step made non-finite is non-finite in the replay too.
        reproduced = replayed is not None and bool((bad.isfinite() | ~replayed.isfinite()).all())
    name = type(opt).__name__
    if origin is None or not reproduced:
        finding.notes.append(Note.of("optimizer-replay-finite", optimizer=name, before=before is not None))
        if finding.source is None:
            # No op named, but the step was made at the user's line that called it, in either timing: the deferred
            # check replays the step with a later step's gradient (the step's own is gone), which can stay finite.
            finding.source = caller
        return
    # The user's line that called the step, unless the op ran in the user's own optimizer code (a hand-written
    # LARS: its trust-ratio line names the op better than ``opt.step()``, in both timings).
    own = origin.source is not None and _in_own_code(type(opt), origin.source)
    attach_origin(finding, dataclasses.replace(origin, source=origin.source if own else caller or origin.source))
    # The replay steps again from what the step left: its operands are the step's own numbers only where it started
    # from a copy taken before the step and the optimizer keeps no state the step had already advanced.
    finding.notes.append(Note.of("optimizer-replayed", op=origin.op, optimizer=name, before=before is not None,
                                 own_numbers=before is not None and not stateful))


def _replay(
    opt: torch.optim.Optimizer, parameter: torch.Tensor, key: str | None, kinds: frozenset[str],
    before: torch.Tensor | None,
) -> tuple[torch.Tensor | None, OpFinding | None, bool]:
    """Run ``opt``'s step for ``parameter`` alone on copies; the replayed bad tensor, the op that started it, and
    whether the parameter had optimizer state (which the step had advanced before the replay starts from it)."""
    group = next(group for group in opt.param_groups if any(p is parameter for p in group["params"]))
    with torch.no_grad():
        start = before if before is not None else parameter
        copy = _finite_copy(start).requires_grad_(parameter.requires_grad)
        if parameter.grad is not None:
            # The step's own gradient was finite (its pre-hook checked it). The deferred check may judge the step
            # after the next backward, whose gradient the non-finite parameters made non-finite: a stand-in of 0
            # for those elements, as for the parameter's, not a NaN the replay would only pass on.
            copy.grad = _finite_copy(parameter.grad)
        state = {name: _finite_copy(value) if isinstance(value, torch.Tensor) else value
                 for name, value in opt.state.get(parameter, {}).items()}
    replica = object.__new__(type(opt))
    replica.__dict__.update(opt.__dict__)
    replica.param_groups = [{**group, "params": [copy]}]
    replica.state = defaultdict(dict, {copy: state} if state else {})
    step: Any = type(opt).step
    # The step without the hooks torch wraps around it: the watch's own optimizer hooks must not see the replay.
    raw = step.__wrapped__ if getattr(step, "hooked", False) else step
    tracer = OpTracer(kinds=kinds, phase_hint=lambda: Phase.OPTIMIZER, at_boundary=True)
    with tracer:
        raw(replica)
    replayed = copy if key is None else replica.state[copy].get(key)
    if not isinstance(replayed, torch.Tensor):
        return None, None, bool(state)
    origin = tracer.claim(replayed)
    return replayed.detach(), origin if isinstance(origin, OpFinding) else None, bool(state)


def _in_own_code(cls: type, source: SourcePointer) -> bool:
    """Whether ``source`` is a line of the file defining optimizer class ``cls``, where that is the user's code."""
    filename = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return (filename is not None and not is_library_file(filename)
            and os.path.abspath(filename) == os.path.abspath(source.filename))


def _finite_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` whose non-finite elements are 0: a stand-in for the finite values the step found."""
    copy: Any = tensor.detach().clone()
    if copy.is_floating_point() or copy.is_complex():
        copy = torch.where(copy.isfinite(), copy, torch.zeros((), dtype=copy.dtype, device=copy.device))
    return copy
