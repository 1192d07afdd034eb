"""The failing step's layer table: every module of the model, measured or not, in call order.

The step's log (hot/kept/step_log.py) holds the calls that returned, with their
numbers. A person reading the table expects every module of the model
(torchinfo's tree), so the modules without a row of their own are added
where they belong, saying why they have no numbers:

* a call still running when the report was made (the producer's parents,
  when a raising watch stopped the step inside them): ``running``;
* a module of a model the step called, that the log has no call of: ``not
  reached`` when a forward was still running (a raising watch stopped the
  step there), ``not called`` when the step ran to its end, ``unchecked`` for
  the modules that pass a finite input through unmeasured (transparent.py),
  and ``not measured`` on a step that checked the model's boundaries only,
  or for a module that ``include``/``exclude``/``types`` leave out.

They are placed in the model's module order (``named_modules``): before the
first measured forward row of a module registered after them.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Iterable

from nan_magic.hot.kept.step_log import StepLog
from nan_magic.hot.watched.targets import ModuleInfo
from nan_magic.records import LayerCall, LayerStatus, Phase, Report, TensorRef, TensorRole, TensorStats

__all__ = ["step_layers", "with_layers", "with_op_row"]


def step_layers(
    log: StepLog, modules: Iterable[ModuleInfo], limit: int, per_module: bool
) -> tuple[tuple[LayerCall, ...], int]:
    """The rows of the step's layer table, in call order, and how many calls were not kept.

    ``modules`` are the watched models' modules in their registration
    order; ``per_module``: whether the step checked every module call
    (a tiered step checks only the models' boundaries).
    """
    measured, dropped = log.layer_calls(limit)
    # The producer rule may record one value a parent passed on twice (judged as two children's input): one row.
    measured = tuple(dict.fromkeys(measured))
    calls = list(log.calls)
    running = [call for call in calls if call.finished < 0 and not call.outputs and call.phase is Phase.FORWARD]
    rows = sorted(
        [*measured, *(LayerCall(call.index, call.phase, call.name, call.module_type, None, "running",
                                path=call.info.path if call.info is not None else None,
                                model=call.info.model if call.info is not None else None) for call in running)],
        key=lambda row: row.index if row.index is not None else -1,
    )
    if dropped:
        return tuple(rows), dropped  # calls not kept: a module without a row may have been called among them
    called = {(call.info.model, call.info.name) for call in calls if call.info is not None}
    models = {model for model, _name in called}
    stopped = any(call.finished < 0 and call.phase is Phase.FORWARD for call in calls)
    order: dict[str, int] = {}
    missing = []
    for info in modules:
        if info.model not in models:
            continue  # a model this step did not call
        order.setdefault(info.name, len(order))
        if (info.model, info.name) not in called:
            missing.append(LayerCall(None, Phase.FORWARD, info.name, info.module_type, None,
                                     _unmeasured(info, stopped, per_module), path=info.path, model=info.model))
    return _merged(rows, missing, order), 0


def with_layers(report: Report | None, layers: tuple[tuple[LayerCall, ...], int]) -> Report | None:
    """``report`` with the rows :func:`step_layers` read (a replay's report takes the whole replayed step's).

    A row the report already had keeps its numbers: they were read at the
    event, while its tensor was alive (a gradient freed since is known only
    to have been checked, not what it held).
    """
    if report is None:
        return None
    at_event = {_key(row): row.stats for row in report.layers if row.stats is not None}
    rows = tuple(dataclasses.replace(row, stats=at_event[_key(row)]) if _key(row) in at_event else row
                 for row in layers[0])
    rows = with_op_row(rows, report.op, report.tensor, report.output_stats, report.module_output)
    return dataclasses.replace(report, layers=rows, layers_dropped=layers[1])


def with_op_row(layers: tuple[LayerCall, ...], op: str | None, tensor: TensorRef, stats: TensorStats | None,
                reached: tuple[TensorRef, object] | None) -> tuple[LayerCall, ...]:
    """The producer's row for its op's own output (``tensor``, ``stats``), where the producer row is the value that
    op reached elsewhere (``reached``, the report's ``module_output``), which becomes a propagated row after it.

    A root's own ``log`` whose -inf a child spread (``output of conv``: 6 +inf, 18 -inf), a loss code's ``log``
    whose -inf the mean made the loss's NaN: the producer row showed that value's counts, not the op's (1 -inf, the
    headline's). A module's own output keeps its producer row (the module is the producer, the op inside it), and a
    gradient its row (a backward op's output is autograd's, not a value of the user's code).
    """
    if op is None or stats is None or reached is None or reached[0].role not in (TensorRole.INPUT, TensorRole.LOSS):
        return layers
    at = next((index for index, layer in enumerate(layers)
               if layer.status == "producer" and layer.tensor == reached[0]), None)
    if at is None:
        return layers
    row = layers[at]
    return (*layers[:at], dataclasses.replace(row, stats=stats, tensor=tensor),
            dataclasses.replace(row, status="propagated"), *layers[at + 1:])


def _key(row: LayerCall) -> tuple[object, ...]:
    return row.index, row.phase, row.module, row.tensor


def _unmeasured(info: ModuleInfo, stopped: bool, per_module: bool) -> LayerStatus:
    if not per_module or not info.watched:
        return "not measured"
    if info.transparent is not None:
        return "unchecked"
    return "not reached" if stopped else "not called"


def _merged(rows: list[LayerCall], missing: list[LayerCall], order: dict[str, int]) -> tuple[LayerCall, ...]:
    """``missing`` put in ``rows``, each before the first forward row of a module registered after it.

    That row is where the running maximum of the forward rows' ranks first
    exceeds the missing module's: a binary search, so that a model of
    thousands of modules costs no quadratic pass at the report.
    """
    forward = [(position, order.get(row.module or "", -1)) for position, row in enumerate(rows)
               if row.phase is Phase.FORWARD]
    peaks = list(itertools.accumulate((rank for _position, rank in forward), max))
    # With no later forward row: after the last row that is not a backward one (the backward follows the forward).
    end = max((position + 1 for position, row in enumerate(rows) if row.phase is not Phase.BACKWARD), default=0)
    slots: dict[int, list[LayerCall]] = {}
    for row in missing:
        found = bisect.bisect_right(peaks, order[row.module or ""])
        slots.setdefault(forward[found][0] if found < len(forward) else end, []).append(row)
    merged: list[LayerCall] = []
    for position, row in enumerate(rows):
        merged.extend(slots.get(position, ()))
        merged.append(row)
    merged.extend(slots.get(len(rows), ()))
    return tuple(merged)
