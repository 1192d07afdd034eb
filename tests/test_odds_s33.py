"""Session 33's leftovers (odds-s33): the user's own exception stays theirs unless a non-finite value reached the op
that raised it (an index made from a NaN, a NaN read into Python by a check that raises on it); each in every mode."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import nan_magic

MODES = [{}, {"defer": True}, {"mode": "full"}, {"ops": True}, {"ops": True, "defer": True}]
IDS = ["default", "defer", "full", "ops", "ops-defer"]


class _Discards(nn.Module):
    """A where that keeps a sqrt's NaN of the negatives out, then ``tail`` (the user's code after it)."""

    def __init__(self, tail: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], trains: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.tail = tail
        self.trains = trains

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.trains:  # (its sqrt detached: no NaN in its backward either)
            h = h + torch.where(h > 0, h.detach().sqrt(), torch.zeros_like(h))
        else:
            h = torch.where(h > 0, h.sqrt(), torch.zeros_like(h))
        return self.tail(h, x)


class _Emb(nn.Module):
    def __init__(self, make_index: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.emb = nn.Embedding(10, 3)
        self.make_index = make_index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.emb(self.make_index(h))


def _users_value_error(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if h.shape[0] > 4:
        raise ValueError("batch larger than the cache")
    return h


def _users_assert(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    assert h.shape[1] == 3, "expected 3 features"
    return h


def _real_out_of_range_id(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.embedding(torch.tensor([0, 99]), h)  # a table of 4 rows: id 99 is the user's bug


def _held_nan_then_shape_error(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    raw = (x - 10).log()  # every value NaN, held in a local, never used
    h = torch.where(torch.isfinite(raw), raw, h)
    return h @ torch.ones(3, 1)


def _shape_error_on_a_nan_mask(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    raw = (x - 10).log()
    missing = torch.isnan(raw)  # where the NaN was: well defined, the user's own handling
    return torch.where(missing[:, :3], torch.zeros_like(h), h)  # 3 columns against 4: the user's bug


def _users_key_error(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return {"a": h}["b"]


USERS = {
    "value_error": (_users_value_error, ValueError, "cache"),
    "assert": (_users_assert, AssertionError, "3 features"),
    "real_out_of_range_id": (_real_out_of_range_id, IndexError, "out of range"),
    "held_nan_then_shape_error": (_held_nan_then_shape_error, RuntimeError, "cannot be multiplied"),
    "key_error": (_users_key_error, KeyError, "b"),
    "shape_error_on_a_nan_mask": (_shape_error_on_a_nan_mask, RuntimeError, "size of tensor"),
}


@pytest.mark.parametrize("options", MODES, ids=IDS)
@pytest.mark.parametrize("name", list(USERS))
def test_the_users_own_error_after_a_discarded_nan_stays_theirs(name: str, options: dict) -> None:
    tail, kind, words = USERS[name]
    torch.manual_seed(0)
    model = _Discards(tail)
    with pytest.raises(kind, match=words) as caught, nan_magic.watch(model, **options):
        model(torch.randn(8, 4))
    assert not isinstance(caught.value, nan_magic.NonFiniteError)


def _check_finite(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    r = h.log()  # the negatives' NaN reaches the user's own check, which raises on it
    if not torch.isfinite(r).all():
        raise ValueError("non-finite activations")
    return r


def _int_of_nan(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    count = int((h.log().sum() * 0).item())  # int(nan): Python's ValueError on the NaN the log made
    return h[:count]


NAN_REACHED = {
    "users_finiteness_check": (_check_finite, "aten.log"),
    "int_of_a_nan": (_int_of_nan, "aten.log"),
}


@pytest.mark.parametrize("options", MODES, ids=IDS)
@pytest.mark.parametrize("name", list(NAN_REACHED))
def test_a_nan_read_by_the_code_that_raised_is_reported(name: str, options: dict) -> None:
    tail, op = NAN_REACHED[name]
    torch.manual_seed(0)
    model = _Discards(lambda h, x: tail(h - 0.5, x))
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, **options):
        model(torch.randn(8, 4))
    report = caught.value.report
    assert report.op == f"{op}.default", report.op
    assert report.phase.value == "forward" and report.nan > 0


INDEXES = {
    "long": lambda h: (h.log() * 0).long()[:, 0],
    "to_int64": lambda h: (h.log() * 0).to(torch.int64)[:, 0],
    "floor_division": lambda h: torch.div(h.log() * 0, 1, rounding_mode="floor").long()[:, 0],
    "rounded": lambda h: (h.log() * 0).round().int()[:, 0],
    "a_sum_of_ids": lambda h: (h.log() * 0).long().sum(-1),
}


@pytest.mark.parametrize("options", MODES, ids=IDS)
@pytest.mark.parametrize("name", list(INDEXES))
def test_an_index_made_from_a_nan_names_the_op_that_made_the_nan(name: str, options: dict) -> None:
    torch.manual_seed(0)
    model = _Emb(INDEXES[name])
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, **options):
        model(torch.randn(8, 4))
    report = caught.value.report
    assert report.op == "aten.log.default", report.op
    assert report.nan > 0 and f"({report.nan} nan of 32)" in str(caught.value).splitlines()[0]  # (was "of 0", ops)


class _ShardUnreadable(OSError):
    pass


def _batches() -> object:
    yield torch.randn(8, 4)
    raise _ShardUnreadable("shard 3 unreadable")  # the data loader's own error, at the second batch


@pytest.mark.parametrize("options", MODES, ids=IDS)
@pytest.mark.parametrize("where", ["loss_code", "data_loader"])
def test_an_error_outside_the_forward_after_a_discarded_nan_stays_the_users(where: str, options: dict) -> None:
    torch.manual_seed(0)
    model = _Discards(lambda h, x: h.sum(-1), trains=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kind = KeyError if where == "loss_code" else _ShardUnreadable
    with pytest.raises(kind) as caught, nan_magic.watch(model, opt, **options):
        for x in _batches():
            out = model(x)
            losses = {"mse": out.pow(2).mean()}
            loss = losses["l1" if where == "loss_code" else "mse"]
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not isinstance(caught.value, nan_magic.NonFiniteError)


@pytest.mark.parametrize("options", MODES, ids=IDS)
def test_a_healthy_step_then_the_users_error_at_step_two_stays_the_users(options: dict) -> None:
    torch.manual_seed(0)
    model = _Discards(lambda h, x: h @ torch.ones(4 if x.shape[0] == 8 else 3, 1), trains=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(RuntimeError, match="cannot be multiplied") as caught, nan_magic.watch(model, opt, **options):
        for batch in (8, 8, 6):
            loss = model(torch.randn(batch, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not isinstance(caught.value, nan_magic.NonFiniteError)


# -- 2. Manual float16 loss scaling: what any rule that calls its skipped overflow benign must still report ---------


class _Half(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, bad: bool = False) -> torch.Tensor:
        h = self.lin(x)
        z = h * 0 if bad else h.abs() + 1
        return self.head(z.sqrt())  # a real NaN (sqrt of an exact 0) in its backward when bad


def _half_loop(model: nn.Module, opt: torch.optim.Optimizer, *, backs_off: bool, bad_step: int | None,
               scale: float) -> None:
    x, y = torch.randn(8, 6).half(), torch.randint(0, 3, (8,))
    for step in range(4):
        loss = nn.functional.cross_entropy(model(x, bad=step == bad_step).float(), y)
        opt.zero_grad()
        (loss * scale).backward()
        if not torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)):
            scale /= 2.0 ** 8 if backs_off else 1
            continue
        for p in model.parameters():
            p.grad /= scale
        opt.step()


@pytest.mark.parametrize("options", MODES, ids=IDS)
def test_a_real_nan_of_a_float16_model_under_a_scale_the_loop_backs_off_is_reported_at_its_step(
        options: dict) -> None:
    torch.manual_seed(0)
    model = _Half().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        _half_loop(model, opt, backs_off=True, bad_step=1, scale=2.0 ** 4)
    report = caught.value.report
    assert (report.phase.value, report.step, report.benign) == ("backward", 1, False)
    assert report.source is not None and "z.sqrt()" in report.source.line


@pytest.mark.parametrize("options", MODES, ids=IDS)
def test_a_float16_overflow_a_loop_skips_without_backing_off_is_reported_at_step_0(options: dict) -> None:
    torch.manual_seed(0)
    model = _Half().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        _half_loop(model, opt, backs_off=False, bad_step=None, scale=2.0 ** 24)
    report = caught.value.report
    assert (report.phase.value, report.step, report.benign) == ("backward", 0, False)
