"""The default flow with the model on a CUDA device: what a GPU user sees.

On CUDA the watch defers its checks (one host read per step), so these tests ask the
same questions as the CPU ones (which producer, which op and line, which phase) of the
deferred path on a real device, and that a healthy watched run changes nothing. Each
is skipped without a GPU; the same deferred code runs on the CPU in test_deferred.py
and, with ``defer=True``, in test_forward.py.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import faults
import pytest
import torch
from faults import FORWARD_FAULTS, Fault
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.records import TensorRef

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

T = TypeVar("T")


def on_cuda(build: Callable[[], T]) -> T:
    """``build()`` with CUDA as the default device, so the model and the batch it makes live there.

    Only the building: the watch itself runs with the user's default device, the CPU.
    """
    previous = torch.get_default_device()
    torch.set_default_device("cuda")
    try:
        return build()
    finally:
        torch.set_default_device(previous)


def watched_error(run: Callable[[], Any], *targets: Any, **options: Any) -> tuple[nan_magic.Watch, Any]:
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*targets, **options) as w:
        run()
    return w, caught.value.report


@pytest.mark.parametrize("fault", FORWARD_FAULTS, ids=lambda f: f.name)
def test_forward_faults_name_the_same_producer_on_cuda(fault: Fault) -> None:
    model, run = on_cuda(fault.build)
    assert next(model.parameters()).is_cuda
    w, report = watched_error(run, model)
    assert w.defer  # the default on a GPU
    assert (report.phase, report.module, report.module_type, report.tensor) == (
        fault.phase, fault.module, fault.module_type, fault.tensor,
    )
    assert report.step == 0
    kinds = {kind for kind, count in report.counts.items() if count}
    assert kinds and kinds <= fault.kinds, f"counts {report.counts} do not match {fault.kinds}"
    if fault.op is not None:  # found by replaying the producer's call
        assert report.op == fault.op
        assert report.source is not None
        assert (report.source.filename, report.source.lineno) == (faults.__file__, faults.marked_line(fault.marker))


@pytest.mark.parametrize("fault", [f for f in FORWARD_FAULTS if f.op is not None][:3], ids=lambda f: f.name)
def test_ops_mode_stops_at_the_op_on_cuda(fault: Fault) -> None:
    model, run = on_cuda(fault.build)
    _w, report = watched_error(run, model, ops=True)
    assert (report.module, report.op) == (fault.module, fault.op)
    assert report.source is not None and report.source.lineno == faults.marked_line(fault.marker)


def test_a_backward_producer_in_the_loss_code_on_cuda() -> None:
    embed, anchor = on_cuda(lambda: (nn.Linear(8, 4), torch.randn(3, 8)))

    def step() -> None:
        embedded = embed(anchor)
        faults.distance(embedded, embedded).sum().backward()  # distance 0: sqrt'(0) = inf, then 0 * inf

    _w, report = watched_error(step, embed)
    assert (report.phase, report.module) == ("backward", None)
    assert report.output_stats is not None and report.output_stats.nan != 0  # None: freed by the check, unknown
    assert any("SqrtBackward0" in note for note in report.notes)


def test_an_optimizer_producer_on_cuda() -> None:
    model, opt, step = on_cuda(faults.fp16_adam_step)
    _w, report = watched_error(step, model, opt)
    seen = (report.phase, report.module, report.tensor, report.step)
    assert seen == ("optimizer", "0", TensorRef.parameter("0.weight"), 0)


def test_an_autocast_float16_overflow_on_cuda_is_replayed_in_float16() -> None:
    model, opt, step = faults.autocast_overflow("cuda")
    w, report = watched_error(step, model, opt)
    assert w.defer
    assert (report.phase, report.module, report.module_type, report.op) == ("forward", "1", "Gram", "aten.mm.default")
    assert (report.source.filename, report.source.lineno) == (faults.__file__, faults.marked_line("gram"))
    assert report.posinf > 0 and report.dtype == "float16"


def _classifier() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 5))
    return model, torch.randn(64, 32), torch.randint(0, 5, (64,))


def test_a_watched_cuda_run_trains_bit_for_bit_like_an_unwatched_one() -> None:
    """The watch reads, never writes: same parameters, same optimizer state, same dropout masks."""

    def train(watched: bool) -> tuple[dict[str, torch.Tensor], list[float], nan_magic.Watch | None]:
        model, x, y = on_cuda(_classifier)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.cuda.manual_seed(1)
        losses: list[torch.Tensor] = []
        watch = nan_magic.watch(model, opt) if watched else None
        with watch if watch is not None else contextlib.nullcontext():
            for _ in range(20):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        state = {key: value.clone() for key, value in model.state_dict().items()}
        return state, [float(loss) for loss in losses], watch

    plain, plain_losses, _ = train(False)
    watched, watched_losses, w = train(True)
    assert w is not None and w.defer and w.report is None and w.events == []
    assert w.step == 20 and len(w.history) == 20
    assert [summary.loss for summary in w.history] == pytest.approx(watched_losses)
    assert watched_losses == plain_losses
    assert all(torch.equal(plain[key], watched[key]) for key in plain)


def test_watching_leaves_no_tensor_on_the_gpu() -> None:
    model, x, y = on_cuda(_classifier)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with nan_magic.watch(model, opt):
        for _ in range(5):
            step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


CELL_SETUP = """
import torch
from torch import nn

class LogLayer(nn.Module):
    def forward(self, x):
        return torch.log(x)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), LogLayer(), nn.Linear(8, 2)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(5, 4, device="cuda")
steps_run = 0
"""

def test_nantrace_cell_on_cuda_reports_the_module_op_and_line(ip) -> None:
    from IPython.utils.capture import capture_output
    from test_magics import TRAIN  # the same training cell as on the CPU

    ip.run_cell(CELL_SETUP)
    ip.user_ns.pop("_nan_report", None)
    with capture_output() as captured:
        result = ip.run_cell("%%nantrace\n" + TRAIN)
    assert isinstance(result.error_in_exec, NonFiniteError)
    assert ip.user_ns["steps_run"] == 1
    report = ip.user_ns["_nan_report"]
    assert (report.phase, report.model, report.module, report.module_type) == ("forward", "model", "2", "LogLayer")
    assert report.op == "aten.log.default"
    assert report.source is not None and report.source.line == "return torch.log(x)"
    assert any("2 (LogLayer)" in out.data.get("text/plain", "") for out in captured.outputs)


@pytest.mark.parametrize("make_scaler", [
    lambda: torch.amp.GradScaler("cuda", init_scale=2.0**24),
    lambda: torch.cuda.amp.GradScaler(init_scale=2.0**24),  # deprecated, still common: the same code path
], ids=["torch.amp", "torch.cuda.amp"])
def test_steps_an_unpassed_cuda_grad_scaler_skips_are_benign(make_scaler: Callable[[], Any]) -> None:
    """fp16 autocast with a GradScaler not passed to watch: its skipped steps are recorded, not raised."""

    def train(watched: bool) -> tuple[list[float], float, nan_magic.Watch | None]:
        model, x, y = on_cuda(_classifier)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp.GradScaler is deprecated
            scaler = make_scaler()
        torch.cuda.manual_seed(1)
        losses: list[torch.Tensor] = []
        watch = nan_magic.watch(model, opt) if watched else None
        with watch if watch is not None else contextlib.nullcontext():
            for _ in range(30):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                losses.append(loss.detach())
        return [float(loss) for loss in losses], scaler.get_scale(), watch

    plain_losses, plain_scale, _ = train(False)
    losses, scale, w = train(True)
    assert w is not None and w.defer and w.report is None
    skipped = len(w.events)
    assert skipped >= 1 and all(event.benign and event.phase == "backward" for event in w.events)
    assert scale == plain_scale == 2.0**24 / 2**skipped
    assert losses == plain_losses
