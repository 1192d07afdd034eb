"""Robustness on real code: re-entered decorators, unreadable tensors, complex and sparse values."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic import NonFiniteError

# -- a decorator-made watch, re-entered (issue 15, item 13) --------------------------------------


class Logs(nn.Module):
    """``log`` of its input: NaN for a negative value, the module that produces it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def log_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Logs())


def test_recursion_runs_inside_the_watch_the_outermost_call_entered() -> None:
    model = log_model()
    w = nan_magic.watch(model)
    depths_active: list[bool] = []

    @w
    def descend(x: torch.Tensor, depth: int) -> torch.Tensor:
        depths_active.append(w.active)
        if depth == 0:
            return model(x)
        return descend(x, depth - 1)

    healthy = torch.full((2, 4), 0.01)
    with torch.no_grad():
        model[0].weight.fill_(0.5)
        model[0].bias.fill_(1.0)
    expected = model(healthy)
    assert torch.equal(descend(healthy, 3), expected)
    assert depths_active == [True] * 4 and not w.active
    # The innermost call is watched: its NaN is caught and named there.
    with torch.no_grad():
        model[0].bias.fill_(-10.0)
    with pytest.raises(NonFiniteError) as caught:
        descend(healthy, 3)
    assert (caught.value.report.module, caught.value.report.phase) == ("1", "forward")
    assert not w.active  # left once, by the outermost call


def test_an_explicit_second_enter_still_says_already_active() -> None:
    w = nan_magic.watch(log_model())

    @w
    def enter_again() -> None:
        with w:
            pass

    with pytest.raises(RuntimeError, match="already active"):
        enter_again()
    assert not w.active


def test_a_second_thread_runs_unwatched_while_the_first_holds_the_watch() -> None:
    model = log_model()
    w = nan_magic.watch(model)
    inside, second_done = threading.Event(), threading.Event()
    results: dict[str, Any] = {}
    bad = torch.full((2, 4), -100.0)  # Linear's output goes negative: log makes NaN

    @w
    def run(x: torch.Tensor, first: bool) -> torch.Tensor:
        if first:
            inside.set()
            assert second_done.wait(timeout=30), "the second thread did not finish"
        return model(x)

    def first() -> None:
        try:
            run(bad, True)
        except BaseException as error:  # the NonFiniteError the first thread must get
            results["first"] = error

    def second() -> None:
        assert inside.wait(timeout=30), "the first thread never entered"
        try:
            results["second"] = run(bad, False)
        except BaseException as error:
            results["second"] = error
        finally:
            second_done.set()

    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    # The second call ran while the watch was active on the first thread: unwatched, no error.
    assert isinstance(results["second"], torch.Tensor), results["second"]
    assert torch.isnan(results["second"]).all()
    # The first thread's own call was watched and named its producer.
    assert isinstance(results["first"], NonFiniteError), results.get("first")
    assert results["first"].report.module == "1"
    assert len(w.events) == 1 and not w.active


# -- complex and sparse values (item 7) ------------------------------------------------------------

MODES = [{}, {"defer": True}, {"mode": "full"}, {"ops": True}]
MODE_IDS = ["default", "defer", "full", "ops"]


def _tiered(options: dict[str, Any]) -> bool:
    """The tiered default reads a model call's inputs and outputs only, not each module's."""
    return options.get("mode") != "full" and not options.get("ops")


class DividesSpectrum(nn.Module):
    """Divides complex values by a complex zero: ``[nan+nanj, inf+infj, inf+nanj]``."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z / torch.zeros_like(z)


@pytest.mark.parametrize("options", MODES, ids=MODE_IDS)
def test_a_complex_tensors_counts_are_per_real_component(options: dict[str, Any]) -> None:
    model = nn.Sequential(nn.Identity(), DividesSpectrum())
    z = torch.tensor([0j, 1 + 1j, 2 + 0j], dtype=torch.complex64)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, **options):
        model(z)
    report = caught.value.report
    assert (report.module, report.phase) == ("1", "forward")
    # nan+nanj counts two NaN, inf+infj two +inf, inf+nanj one of each: 3 elements, 6 components.
    assert report.counts == {"nan": 3, "+inf": 3, "-inf": 0}
    assert report.numel == 6
    assert report.output_stats is not None
    assert (report.output_stats.dtype, report.output_stats.shape) == ("complex64", (3, 2))


def test_values_to_read_of_each_layout() -> None:
    from nan_magic.hot.reads import is_checkable, values_to_read
    from nan_magic.hot.stats import tensor_stats

    dense = torch.tensor([[1.0, float("nan")], [0.0, 3.0]])
    coo = dense.to_sparse()  # stores 3 values: 1, nan, 3
    csr = dense.to_sparse_csr()
    complex_coo = torch.complex(dense, torch.full_like(dense, float("inf"))).to_sparse()
    conjugated = torch.complex(dense, -dense).conj()  # a lazily conjugated view
    for tensor, (numel, nan, posinf, neginf) in [
        (coo, (3, 1, 0, 0)),
        (csr, (3, 1, 0, 0)),
        (complex_coo, (8, 1, 4, 0)),  # all 4 stored (0+infj is not zero), each with an infinite imaginary part
        (conjugated, (8, 2, 0, 0)),
    ]:
        assert is_checkable(tensor)
        values = values_to_read(tensor)
        assert values.layout is torch.strided and values.is_floating_point()
        stats = tensor_stats(tensor)
        assert (stats.numel, stats.nan, stats.posinf, stats.neginf) == (numel, nan, posinf, neginf), tensor
    assert not is_checkable(torch.ones(2, dtype=torch.int64).to_sparse())


def test_a_sparse_gradients_norm_is_its_stored_values_norm() -> None:
    from nan_magic.hot.reads import norms, read_scalars

    grad = torch.sparse_coo_tensor(torch.tensor([[0, 3, 3]]), torch.tensor([3.0, 4.0, 0.0]), (10,))
    spoiled = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.tensor([float("inf")]), (10,))
    dense = torch.full((4,), 2.0)
    assert read_scalars(norms([grad, dense, spoiled])) == [5.0, 4.0, math.inf]


# -- what the watch cannot read (item 12) ----------------------------------------------------------


class Head(nn.Module):
    """A head whose log makes NaN of a negative value."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x - 100.0)


def encoder_then_head() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    model = nn.Sequential()
    model.add_module("encoder", nn.TransformerEncoder(layer, 2))
    model.add_module("head", Head())
    model.eval()
    x = torch.randn(2, 5, 16)
    padding = torch.tensor([[False] * 5, [False, False, False, True, True]])
    return model, x, padding


@pytest.mark.parametrize("options", MODES, ids=MODE_IDS)
def test_nested_tensors_are_skipped_counted_and_shown_in_the_report(options: dict[str, Any]) -> None:
    model, x, padding = encoder_then_head()
    with torch.no_grad():
        expected = model.encoder(x, src_key_padding_mask=padding)
    with torch.no_grad(), nan_magic.watch(model, **options) as w:
        got = model.encoder(x, src_key_padding_mask=padding)
        assert torch.equal(got, expected)  # the fast path ran as unwatched, bit for bit
        assert w.report is None
        # Each layer's output is a nested tensor (the fast path packs the padded batch); the encoder's
        # own output, all the tiered watch reads, is padded again.
        assert w.skipped["nested"] >= (0 if _tiered(options) else 2), dict(w.skipped)
        with pytest.raises(NonFiniteError) as caught:
            model.head(got)
    report = caught.value.report
    assert (report.module, report.module_type, report.op) == ("head", "Head", "aten.log.default")
    assert dict(report.skipped).get("nested", 0) == w.skipped["nested"]
    if not _tiered(options):
        assert "skipped" in report.to_text() and "nested: " in report.to_text()
        assert "it cannot read, left unchecked (nested: " in report.to_html()


@pytest.mark.parametrize("options", MODES, ids=MODE_IDS)
def test_meta_and_dispatching_subclass_tensors_are_skipped_and_counted(options: dict[str, Any]) -> None:
    from contract.robust import Wrapped

    with torch.device("meta"):
        meta_model = nn.Linear(4, 4)
    model = nn.Linear(4, 4)
    wrapped = Wrapped(torch.randn(2, 4))
    with torch.no_grad():
        expected = model(wrapped).inner
    with torch.no_grad(), nan_magic.watch(meta_model, model, **options) as w:
        meta_model(torch.empty(2, 4, device="meta"))
        got = model(wrapped).inner
    assert torch.equal(got, expected)
    assert w.report is None
    assert w.skipped["meta"] >= 2 and w.skipped["Wrapped"] >= 2, dict(w.skipped)  # input and output of each


TRANSFORMS = {
    "vmap": lambda model, x: torch.func.vmap(model)(x),
    "grad": lambda model, x: torch.func.grad(lambda row: model(row).sum())(x[0]),
    "functionalize": lambda model, x: torch.func.functionalize(model)(x[0]),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("options", MODES, ids=MODE_IDS)
def test_values_inside_a_torch_func_transform_are_read_through_it(transform: str, options: dict[str, Any]) -> None:
    # Reading a vmapped value to the host raises inside vmap: the watch crashed the user's code. vmap's and grad's
    # values are read through the plain tensor they wrap (hot/wrapped.py), never by .item() on the wrapper; those of
    # functionalize (whose inner tensor may lag its pending writes) are skipped and counted.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(3, 2, 4)
    expected = TRANSFORMS[transform](model, x)
    with nan_magic.watch(model, **options) as w:
        got = TRANSFORMS[transform](model, x)
    assert torch.equal(got, expected)
    assert w.report is None
    if transform == "functionalize":  # input and both outputs, at least (the tiered watch: the model's in and out)
        assert w.skipped["functorch"] >= (2 if _tiered(options) else 3), dict(w.skipped)
    else:
        assert not w.skipped, dict(w.skipped)


@pytest.mark.parametrize("options", MODES, ids=MODE_IDS)
def test_fake_tensors_are_skipped_and_counted(options: dict[str, Any]) -> None:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(3, 4)
        with nan_magic.watch(model, **options) as w:
            out = model(x)
    assert isinstance(out, FakeTensor) and tuple(out.shape) == (3, 4)
    assert w.report is None and w.skipped["FakeTensor"] >= (2 if _tiered(options) else 3), dict(w.skipped)


def test_ops_tracer_starts_an_origin_on_a_sparse_output_without_reading_its_storage() -> None:
    # A sparse tensor has no one storage: the tracer's memory key must not be built for it.
    from nan_magic.localize.ops.tracer import OpTracer

    values = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2))
    tracer = OpTracer(kinds=frozenset({"nan", "inf"}), at_boundary=True)
    with tracer:
        overflowed = values * 1e39  # float32 overflows: +inf stored values
    origin = tracer.origin_of(overflowed)
    assert origin is not None and origin != "benign" and origin.op == "aten.mul.Tensor"
