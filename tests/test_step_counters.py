"""A BatchNorm's step counter is not copied on a healthy step; a replay still sees it as it was before the call.

A step replay runs a top-level call again from its buffers as they were before it (replay/tiered/step.py). torch's
BatchNorm writes its running statistics without moving their version counters (they are replayed as the step left
them, as before), and ``num_batches_tracked`` by ``add_(1)``, one version a call: so that counter is not copied at
each call (hot/kept/buffer_copies.py ``step_counters``), its value before the call is counted back from its version
at the replay (``counted_back``). torch's BatchNorm reads it only with ``momentum=None``; a user's forward may read it
too (a warm-up that ends at a count): the replay must take the branch the call took.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from tests.faults import marked_line

MODES = [
    pytest.param({}, id="default"),
    pytest.param({"defer": True}, id="deferred"),
    pytest.param({"mode": "full"}, id="full"),
    pytest.param({"ops": True}, id="ops"),
    pytest.param({"ops": True, "defer": True}, id="ops-deferred"),
]
#: The call whose count ends the warm-up (the third: steps 0, 1, 2).
WARM = 3


class _WarmUp(nn.Module):
    """A forward that reads its BatchNorm's step counter (a warm-up that ends at a count)."""

    def __init__(self, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4, momentum=momentum)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc(x))
        if int(self.bn.num_batches_tracked) == WARM:
            h = h.log()  # producer: warm-up ends
        return self.out(h)


def _line(marker: str) -> int:
    return marked_line(marker, where=sys.modules[__name__])


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("options", MODES)
def test_a_forward_reading_the_counter_is_replayed_from_its_count_before_the_call(options, momentum) -> None:
    torch.manual_seed(0)
    model = _WarmUp(momentum)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for _step in range(5):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    op = None if options == {"mode": "full"} else "aten.log.default"  # (the per-module watch names no op)
    assert (report.phase, report.step, report.op) == ("forward", WARM - 1, op)
    assert report.reproduced is not False
    if op is not None:
        assert report.source is not None and report.source.lineno == _line("warm-up ends")
    # The replays counted on copies: the model's counter is the loop's three calls, as it was.
    assert int(model.bn.num_batches_tracked) == WARM


def test_a_training_batch_norm_model_copies_no_buffer_after_its_first_call() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nan_magic.watch(model, opt) as w:
        for step in range(3):
            model(torch.randn(2, 3, 8, 8)).sum().backward()
            assert w.replays is not None
            (root,) = w.replays.calls
            # The first call copies every buffer (what each changes is not known yet); then none is copied.
            assert (len(root.buffers) == 3) if step == 0 else (root.buffers == {})
            before = root.buffers_before()
            counter = model[1].num_batches_tracked
            assert int(before[id(counter)]) == step and int(counter) == step + 1
            opt.step()
            opt.zero_grad()


def test_a_batch_norm_subclass_with_its_own_forward_keeps_its_counter_copied() -> None:
    class Counting(nn.BatchNorm1d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.num_batches_tracked.add_(2)  # (counted its own way: not one version a call)
            return super().forward(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Counting(4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nan_magic.watch(model, opt) as w:
        for step in range(3):
            model(torch.randn(8, 4)).sum().backward()
            assert w.replays is not None
            (root,) = w.replays.calls
            counter = model[1].num_batches_tracked
            assert int(root.buffers_before()[id(counter)]) == 3 * step and int(counter) == 3 * (step + 1)
            opt.step()
            opt.zero_grad()


def test_a_compiled_or_distributed_model_keeps_its_counters_copied(tmp_path) -> None:
    """Their forwards may move a counter's version otherwise than once a call: the counter is copied, as it moves."""
    import torch.distributed as dist

    from nan_magic.hot.kept.buffer_copies import step_counters

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert step_counters(model) == {id(model[1].num_batches_tracked)}
    wrapper = nn.Module()
    wrapper._orig_mod = model  # (what torch.compile's OptimizedModule holds)
    assert step_counters(wrapper) == frozenset()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert step_counters(nn.parallel.DistributedDataParallel(model)) == frozenset()
    finally:
        dist.destroy_process_group()


def test_the_first_calls_copies_are_let_go_when_no_later_call_copies_a_buffer() -> None:
    """A BatchNorm model's first call copies every buffer (a large constant one too); no later call copies into them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    model.register_buffer("table", torch.zeros(1 << 16))  # (a constant: never moved, never copied after the first call)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nan_magic.watch(model, opt) as w:
        for _step in range(3):
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert w.replays is not None
        held = [copy for _sources, copies in w.replays._buffer_copies._spare.values() for copy in copies.values()]
        assert sum(copy.numel() for copy in held) < 1 << 16  # (no copy of the table kept for the watch)
