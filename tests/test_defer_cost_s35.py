"""A silent step pays nothing for ops mode's deferred counting (round 35, review of defer-s35).

``ops=True, defer=True`` keeps the counts of what an op's non-finite origin reached, for a boundary its check may
find freed (localize/ops/origins.Origins._counted). It ran the full ``tensor_stats`` (host reads, a float64 copy) on
each such tensor as the op made it, on every step where an op made a non-finite value, even one whose value was
absorbed and the step stayed silent: a model's ``torch.where(h > 0, torch.log(h), 0)`` (22% of the step), a
``no_grad`` entropy metric ``(p * p.log()).nan_to_num()`` (20%), GradScaler's skipped overflow steps (55%). It now
counts on the device alone, only what may be a boundary, and reads the counts only where a freed boundary is judged.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from contract import all_cases
from torch import nn

import nan_magic
import nan_magic.localize.ops.origins as origins_module
from nan_magic import NonFiniteError
from nan_magic.hot.stats import PendingCounts


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many tensors the deferred counting read to the host (full statistics, kept counts read) and kept."""
    seen = {"stats": 0, "read": 0, "kept": 0}
    stats, read, kept = origins_module.tensor_stats, PendingCounts.stats, PendingCounts.__init__
    counting = origins_module.Origins._counted
    inside = [False]

    def counted_stats(tensor: torch.Tensor) -> Any:
        seen["stats"] += inside[0]  # (the counting's, not a report's: a skipped step's finding is built, then benign)
        return stats(tensor)

    def counted_counting(self: Any, *args: Any) -> Any:
        inside[0] = True
        try:
            return counting(self, *args)
        finally:
            inside[0] = False

    def counted_read(self: PendingCounts) -> Any:
        seen["read"] += 1
        return read(self)

    def counted_keep(self: PendingCounts, *args: Any) -> None:
        seen["kept"] += 1
        kept(self, *args)

    monkeypatch.setattr(origins_module, "tensor_stats", counted_stats)
    monkeypatch.setattr(origins_module.Origins, "_counted", counted_counting)
    monkeypatch.setattr(PendingCounts, "stats", counted_read)
    monkeypatch.setattr(PendingCounts, "__init__", counted_keep)
    return seen


class _SafeLog(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.out(torch.where(h > 0, torch.log(h), torch.zeros_like(h)))  # log of h <= 0: NaN, absorbed


def _train(model: nn.Module, steps: int, metric: bool) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(steps):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        out = model(x)
        if metric:
            with torch.no_grad():  # a logged entropy: p * log p is NaN where p is exactly 0
                p = torch.cat([out.sigmoid(), torch.zeros_like(out)], 1)
                (p * p.log()).nan_to_num().sum()
        opt.zero_grad()
        out.pow(2).mean().backward()
        opt.step()
    return [q.detach().clone() for q in model.parameters()]


@pytest.mark.parametrize("metric", [pytest.param(False, id="where-in-the-model"),
                                    pytest.param(True, id="no-grad-metric-too")])
def test_a_silent_step_with_an_absorbed_nan_reads_nothing_under_ops_defer(reads: dict[str, int], metric: bool) -> None:
    torch.manual_seed(0)
    reference = _train(_SafeLog(), 3, metric)
    torch.manual_seed(0)
    model = _SafeLog()
    with nan_magic.watch(model, ops=True, defer=True):  # (silent: no NonFiniteError)
        watched = _train(model, 3, metric)
    assert all(torch.equal(a, b) for a, b in zip(reference, watched))
    assert (reads["stats"], reads["read"]) == (0, 0), reads


def test_a_no_grad_metric_keeps_no_counts_under_ops_defer(reads: dict[str, int]) -> None:
    """Outside every module, under no_grad, a value is no boundary the check could find freed: nothing is counted."""
    model = nn.Linear(8, 1)
    with nan_magic.watch(model, ops=True, defer=True), torch.no_grad():
        p = torch.cat([model(torch.randn(4, 8)).sigmoid(), torch.zeros(4, 1)], 1)
        (p * p.log()).nan_to_num().sum()
    assert reads == {"stats": 0, "read": 0, "kept": 0}


def test_gradscaler_skipped_overflow_steps_read_nothing_under_ops_defer(reads: dict[str, int]) -> None:
    """A scale of 2**40 overflows float16 gradients on any machine: each step is skipped, silent (benign)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=1000)
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
    with nan_magic.watch(model, opt, ops=True, defer=True):
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() == 2.0**37  # (three skipped steps, each halving it)
    assert (reads["stats"], reads["read"]) == (0, 0), reads
    # Counted on the device: only the gradients the watch's hooks record (into the three modules' outputs and the
    # model's), not every backward op's output the overflow reached (casts, matmuls, GELU's, the bias sums).
    assert reads["kept"] <= 3 * 4, reads


@pytest.mark.parametrize("name", ["gaps21_direct_child_backward_sqrt_of_zero",
                                  "hunt23_attention_soft_cap_disabled_by_0_backward"])
def test_a_freed_boundary_gradient_keeps_its_counts_and_first_index_from_the_device(name: str) -> None:
    """The counts kept on the device are those ops=True reads of the live gradient, and so is its first bad index
    (the report's "first at" row)."""
    case = next(case for case in all_cases() if case.name == name)

    def report(**options: Any) -> Any:
        torch.manual_seed(0)
        scenario = case.build()
        with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options,
                                                                     **scenario.options):
            scenario.run()
        return caught.value.report

    now, late = report(ops=True), report(ops=True, defer=True)
    assert str(late.tensor).startswith("grad of"), late.message
    seen = [(str(r.tensor), dict(r.counts), r.first_bad_index) for r in (now, late)]
    assert seen[1] == seen[0] and seen[0][2] is not None


def test_the_watchs_own_counts_of_a_freed_boundary_are_not_traced_as_the_users_ops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted inside the watch's gradient hook while the op tracer's mode is on, the counts' own ops (isnan,
    count_nonzero, argmax) went through its dispatch as if the user's backward had run them (review of
    defer-fix-s35): they run with the mode off."""
    import nan_magic.localize.ops.tracer as tracer_module

    inside, traced = [False], []
    dispatch, count = tracer_module.OpTracer.__torch_dispatch__, origins_module.Origins.count_boundary

    def seen(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if inside[0]:
            traced.append(str(func))
        return dispatch(self, func, types, args, kwargs)

    def counting(self: Any, tensor: torch.Tensor) -> None:
        inside[0] = True
        try:
            count(self, tensor)
        finally:
            inside[0] = False

    monkeypatch.setattr(tracer_module.OpTracer, "__torch_dispatch__", seen)
    monkeypatch.setattr(origins_module.Origins, "count_boundary", counting)
    case = next(case for case in all_cases() if case.name == "gaps21_direct_child_backward_sqrt_of_zero")
    scenario = case.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, ops=True, defer=True,
                                                                 **scenario.options):
        scenario.run()
    assert str(caught.value.report.tensor).startswith("grad of") and traced == []
