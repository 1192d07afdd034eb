"""The deferred watch (what a GPU runs) names what the immediate one names: round 31.

- Every incident row of tests/contract/defer_s31.py: the deferred report names the module, op, line, phase, step
  and cause the immediate one names, and ``%debug`` opens at the same line (ops=True likewise with defer=True).
- A batch built in a data helper holding a sparse tensor (a GCN's normalised adjacency): the helper's frame is kept
  for the deferred check as for the immediate one (a sparse tensor's size is its index and value tensors', not
  "unknown, so large"): ``%debug`` opens at the helper's op, not at the model call.
- Where ``%debug`` cannot open at the report's line because the function that ran it returned before the deferred
  check (a helper that called the model, ``loss_of(model)``; a ``run()`` whose last ``opt.step()`` is judged as the
  watch is left), the report says so and where, not that it opens "a replay at the report's line".
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from contract import Case, defer_s31
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic import NonFiniteError

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]


def _line(pointer: Any) -> tuple[str, int] | None:
    return None if pointer is None else (os.path.basename(pointer.filename), pointer.lineno)


def _marker(key: str) -> int:
    with open(__file__) as source:
        return next(n for n, text in enumerate(source, 1) if text.rstrip().endswith(f"# here: {key}"))


def _report(targets: tuple[Any, ...], run: Any, options: dict[str, Any]) -> Any:
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*targets, **options):
        run()
    return caught.value.report


def _seen(case: Case, options: dict[str, Any]) -> dict[str, Any]:
    """What a user reads off the row's report: where, what, why, and where %debug opens."""
    torch.manual_seed(0)
    scenario = case.build()
    report = _report(scenario.targets, scenario.run, {**options, **scenario.options})
    return {"module": report.module, "op": report.op, "source": _line(report.source), "phase": report.phase,
            "step": report.step, "cause": None if report.cause is None else report.cause.label,
            "debug": _line(report.debug_frame)}


INCIDENTS = [pytest.param(case, id=case.name) for case in defer_s31.CASES if case.expect is not None]


@pytest.mark.parametrize("case", INCIDENTS)
@pytest.mark.parametrize("ops", [pytest.param(False, id="default"), pytest.param(True, id="ops")])
def test_deferred_report_and_debug_line_are_the_immediate_ones(case: Case, ops: bool) -> None:
    base = {"ops": True} if ops else {}
    now, late = _seen(case, base), _seen(case, {**base, "defer": True})
    assert now["op"] is not None and now["source"] is not None and now["debug"] is not None, now
    assert late == now


# ---------------------------------------------------------------- a sparse adjacency built in a data helper
def _sparse_gcn(self_loops: bool):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    l1, l2 = nn.Linear(4, 8), nn.Linear(8, 2)
    model = nn.ModuleDict({"l1": l1, "l2": l2})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = [torch.randn(5, 4) for _ in range(3)], [torch.randn(5, 2) for _ in range(3)]
    edges = [torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 0]]), torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]]),
             torch.tensor([[0, 1, 2, 3, 4], [2, 3, 4, 0, 1]])]

    class Gcn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = l1, l2

        def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
            return torch.sparse.mm(adj, self.l2(torch.sparse.mm(adj, self.l1(x)).relu()))

    gcn = Gcn()

    def adjacency(e: torch.Tensor) -> torch.Tensor:
        if self_loops:
            e = torch.cat([e, torch.arange(5).repeat(2, 1)], 1)
        a = torch.sparse_coo_tensor(e, torch.ones(e.shape[1]), (5, 5)).coalesce()
        inv_sqrt = torch.sparse.sum(a, 1).to_dense().pow(-0.5)  # here: degree
        i = a.indices()
        return torch.sparse_coo_tensor(i, inv_sqrt[i[0]] * a.values() * inv_sqrt[i[1]], (5, 5))

    def run() -> None:
        for step in range(3):
            loss = F.mse_loss(gcn(xs[step], adjacency(edges[step])), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return (gcn, opt), run


@pytest.mark.parametrize("options", TIMINGS)
def test_sparse_batch_helper_frame_is_where_debug_opens(options: dict[str, Any]) -> None:
    report = _report(*_sparse_gcn(False), options)
    assert (report.phase, report.step, report.op) == ("data", 1, "aten.pow.Tensor_Scalar")
    assert _line(report.source) == ("test_defer_s31.py", _marker("degree"))
    assert _line(report.debug_frame) == ("test_defer_s31.py", _marker("degree")), report.to_text()


def test_sparse_batch_helper_healthy_twin_is_silent() -> None:
    targets, run = _sparse_gcn(True)
    with nan_magic.watch(*targets, defer=True):
        run()


# ---------------------------------------------------------------- a model called in a helper that returned
def _spectral_in_a_helper():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    nn.init.zeros_(model[2].weight)
    nn.utils.parametrizations.spectral_norm(model[2])  # W / sigma(W): 0 / 0
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(6, 4)

    def loss_of(m: nn.Module) -> torch.Tensor:
        return F.softplus(-m(x)).mean()  # here: helper call

    def run() -> None:
        loss = loss_of(model)
        opt.zero_grad()
        loss.backward()
        opt.step()  # here: the check
    return (model, opt), run


@pytest.mark.parametrize("options", TIMINGS)
def test_returned_helper_that_called_the_model_is_named_where_debug_cannot_open(options: dict[str, Any]) -> None:
    report = _report(*_spectral_in_a_helper(), options)
    assert (report.module, report.op) == ("2.parametrizations.weight.0", "aten.div.Tensor")
    assert _line(report.source) == ("test_defer_s31.py", _marker("helper call"))
    kinds = {note.kind for note in report.note_facts}
    if not options:
        assert _line(report.debug_frame) == _line(report.source)
        assert "debug-frame-returned" not in kinds
        return
    # Judged at opt.step(): loss_of has returned, a replay of the model call does not run it again.
    assert _line(report.debug_frame) == ("test_defer_s31.py", _marker("the check"))
    assert "debug-in-replay" not in kinds, report.to_text()
    said = [note for note in report.note_facts if note.kind == "debug-frame-returned"]
    assert said and (said[0].fact("function"), said[0].fact("line")) == ("loss_of", _marker("helper call"))
    assert "not in loss_of at line" in report.to_text()


# ---------------------------------------------------------------- the last step of a run() judged as the watch is left
def _adam_last_step_in_a_function():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    trunk, aux = nn.Linear(4, 4), nn.Linear(4, 1)
    model = nn.ModuleDict({"trunk": trunk, "aux": aux})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0, foreach=False)
    xs = [torch.randn(5, 4) for _ in range(3)]

    def run() -> None:
        for step in range(3):
            h = trunk(xs[step])
            loss = h.pow(2).mean()
            if step == 2:
                loss = loss + 0.0 * aux(h).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()  # here: last step
    return (model, opt), run


@pytest.mark.parametrize("options", TIMINGS)
def test_last_step_of_a_returned_function_says_where_debug_cannot_open(options: dict[str, Any]) -> None:
    report = _report(*_adam_last_step_in_a_function(), options)
    assert (report.phase, report.module, report.step) == ("optimizer", "aux", 2)
    assert _line(report.source) == ("test_defer_s31.py", _marker("last step"))
    said = [note for note in report.note_facts if note.kind == "debug-frame-returned"]
    if not options:
        assert _line(report.debug_frame) == _line(report.source) and not said
        return
    assert said and (said[0].fact("function"), said[0].fact("line")) == ("run", _marker("last step")), \
        report.to_text()


# ---------------------------------------------------------------- a batch helper whose frame is too large to keep
def _large_batch_helper():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    raws, ys = [torch.rand(5, 4) for _ in range(3)], [torch.randn(5, 2) for _ in range(3)]
    raws[1][2] = 0.0

    def make_batch(step: int) -> torch.Tensor:
        table = torch.randn(700, 1000)  # a 2.8 MB local: the returned helper's frame is not kept past the call
        raw = raws[step] + 0 * table[0, :4]
        return raw / raw.sum(1, keepdim=True)  # here: row sums

    def run() -> None:
        for step in range(3):
            loss = F.mse_loss(model(make_batch(step)), ys[step])  # here: model call
            opt.zero_grad()
            loss.backward()
            opt.step()
    return (model, opt), run


@pytest.mark.parametrize("options", TIMINGS)
def test_batch_helper_frame_let_go_is_said(options: dict[str, Any]) -> None:
    report = _report(*_large_batch_helper(), options)
    assert (report.phase, report.step, report.op) == ("data", 1, "aten.div.Tensor")
    assert _line(report.source) == ("test_defer_s31.py", _marker("row sums"))
    said = [note for note in report.note_facts if note.kind == "frame-let-go"]
    if not options:
        assert _line(report.debug_frame) == _line(report.source) and not said
        return
    # Judged at opt.step(): %debug opens at the model call, and the report says why not in make_batch.
    assert _line(report.debug_frame) == ("test_defer_s31.py", _marker("model call"))
    assert said and said[0].fact("function") == "make_batch", report.to_text()


# ---------------------------------------------------------------- a fix trial of a call under no_grad with a loss kept
def test_no_grad_teacher_fix_is_judged_by_the_loss_not_a_backward_through_it() -> None:
    """A float16 teacher under no_grad overflows; the deferred check has the student's loss code: the float32 trial
    is judged by that loss (finite), not by a backward through the teacher, which the user's step never runs."""
    from contract import hunt16

    case = next(case for case in hunt16.CASES if case.name == "hunt16_distillation_float16_teacher_overflows")
    for options in ({}, {"defer": True}):
        torch.manual_seed(0)
        scenario = case.build()
        report = _report(scenario.targets, scenario.run, {**options, **scenario.options})
        trial = next(trial for trial in report.fixes if trial.kind == "float32")
        assert trial.finite, report.to_text()
        assert not trial.fact("stepped")
        if options:
            assert trial.fact("backward_from") == "no-grad-loss" and trial.loss is not None, trial
            assert "no backward or optimizer step runs through it" in report.to_text()
