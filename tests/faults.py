"""Small models that fail deterministically, each with the producer it must report.

Each fault is a :class:`Fault`: ``build()`` returns ``(model, run)`` where
``run()`` executes the failing code once; ``expect`` holds what the report
must say. The line the producer's op sits on is marked in the source with a
``# producer: <key>`` comment so tests can find it without hard-coded numbers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nan_magic.records import TensorRef


def marked_line(key: str, kind: str = "producer", where: Any = None) -> int:
    """Line number of the ``# producer: key`` (or ``# <kind>: key``) comment.

    In this file, or in the module that defines ``where`` (a test module's
    ``sys.modules[__name__]``).
    """
    module = inspect.getmodule(where if where is not None else marked_line)
    lines = inspect.getsource(module).splitlines()  # type: ignore[arg-type]
    matches = [number for number, text in enumerate(lines, 1) if text.rstrip().endswith(f"# {kind}: {key}")]
    assert len(matches) == 1, f"marker {key!r} found {len(matches)} times"
    return matches[0]


class GuardedExp(nn.Module):
    """exp for small inputs, identity otherwise; exp overflows in the branch not taken."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x < 20, torch.exp(x), x)  # producer: guarded exp


def fp16_adam_step() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """Adam in pure float16 with eps=1e-8, which rounds to 0: rows with zero gradients get 0 / 0.

    Returns ``(model, opt, step)``; only rows 1 and 2 of the embedding (of 10 x 4) get gradients.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1)).half()
    opt = torch.optim.Adam(model.parameters(), eps=1e-8)
    tokens = torch.tensor([1, 2])

    def step() -> None:
        opt.zero_grad()
        model(tokens).float().sum().backward()
        opt.step()  # producer: adam

    return model, opt, step


class Gram(nn.Module):
    """``x @ x.T``: finite in float32; in float16 it overflows once |x| is about 32 over 64 features."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ x.transpose(-1, -2)  # producer: gram


def autocast_overflow(device: str) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """A training step whose forward runs under float16 autocast; ``Gram`` overflows only there.

    The LayerNorm runs in float32 under autocast (its output reaches about 40 * 3); autocast casts
    it to float16 for the matmul. Returns ``(model, opt, step)``; the producer is module ``"1"``.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(64), Gram()).to(device)
    with torch.no_grad():
        model[0].weight.fill_(40.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 64, device=device)

    def step() -> None:
        with torch.autocast(device, dtype=torch.float16):
            loss = model(x).float().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    return model, opt, step


def distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Euclidean distance per row: sqrt at 0 (equal rows) has an infinite derivative."""
    return torch.sqrt(((a - b) ** 2).sum(-1))  # producer: distance


_OUTPUT = TensorRef.output()


@dataclass
class Fault:
    name: str
    build: Callable[[], tuple[nn.Module, Callable[[], Any]]]
    phase: str
    module: str | None
    module_type: str | None
    tensor: TensorRef = _OUTPUT
    kinds: frozenset[str] = frozenset({"nan"})
    op: str | None = None
    marker: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# -- models -------------------------------------------------------------------


class LogLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # producer: log


class HandNorm(nn.Module):
    """LayerNorm written by hand, without eps: divides by a zero std."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centred = x - x.mean(-1, keepdim=True)
        return centred / centred.pow(2).mean(-1, keepdim=True).sqrt()  # producer: norm


class HalfMatmul(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((width, width), 60.0, dtype=torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight  # producer: fp16


class TwoHeads(nn.Module):
    """Returns a tuple; the second element goes bad (sqrt of a negative)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, torch.sqrt(x - 10)  # producer: tuple


class DictHeads(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"finite": x + 1, "logits": x / torch.zeros_like(x)}  # producer: dict


class Scale(nn.Module):
    """Multiplies by a fixed factor: harmless once, overflows float16 the second time."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor  # producer: twice


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.scale = Scale(1000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).half().clamp(-1, 1)
        h = self.scale(h)  # |h| <= 1000 fits in float16
        return self.scale(h)  # up to 1e6 does not: the second call produces inf


class Shared(nn.Module):
    """One LogLayer instance reachable under two names; its second use goes bad."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.act = LogLayer()
        self.again = self.act  # the same module object under a second name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.first(x).abs() + 1)  # log of values >= 1: finite
        return self.again(h - 5)  # log of negatives: NaN  # caller: shared


def _seed() -> None:
    torch.manual_seed(0)


def _inf_weight() -> tuple[nn.Module, Callable[[], Any]]:
    _seed()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    with torch.no_grad():
        model[2].weight[3, 5] = float("inf")
    x = torch.randn(4, 8)
    return model, lambda: model(x)


def _log_negative() -> tuple[nn.Module, Callable[[], Any]]:
    _seed()
    model = nn.Sequential(nn.Linear(8, 8), LogLayer(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    return model, lambda: model(x)


def _zero_variance() -> tuple[nn.Module, Callable[[], Any]]:
    _seed()
    model = nn.Sequential(nn.Linear(8, 8), HandNorm(), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight.zero_()  # every output row constant: its std is exactly 0
        model[0].bias.fill_(0.5)
    x = torch.randn(4, 8)
    return model, lambda: model(x)


def _fp16_overflow() -> tuple[nn.Module, Callable[[], Any]]:
    _seed()
    model = nn.Sequential(nn.Identity(), HalfMatmul(64), nn.Identity())
    x = torch.full((2, 64), 20.0, dtype=torch.float16)  # 64 * 20 * 60 = 76800 > 65504
    return model, lambda: model(x)


def _nan_in_batch() -> tuple[nn.Module, Callable[[], Any]]:
    _seed()
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    x[2, 3] = float("nan")
    return model, lambda: model(x)


def _tuple_output() -> tuple[nn.Module, Callable[[], Any]]:
    _seed()
    model = nn.Sequential(nn.Linear(8, 8), TwoHeads())
    x = torch.randn(4, 8)
    return model, lambda: model(x)


def _dict_output() -> tuple[nn.Module, Callable[[], Any]]:
    _seed()
    model = nn.Sequential(nn.Linear(8, 8), DictHeads())
    x = torch.randn(4, 8)
    return model, lambda: model(x)


def _called_twice() -> tuple[nn.Module, Callable[[], Any]]:
    _seed()
    model = CalledTwice()
    x = torch.randn(4, 4)
    return model, lambda: model(x)


def _shared() -> tuple[nn.Module, Callable[[], Any]]:
    _seed()
    model = Shared()
    x = torch.randn(4, 4)
    return model, lambda: model(x)


FORWARD_FAULTS = [
    Fault("inf_weight", _inf_weight, "forward", "2", "Linear", tensor=TensorRef.parameter("2.weight"),
          kinds=frozenset({"+inf"})),
    Fault("log_negative", _log_negative, "forward", "1", "LogLayer", op="aten.log.default", marker="log"),
    Fault("zero_variance", _zero_variance, "forward", "1", "HandNorm", op="aten.div.Tensor", marker="norm"),
    Fault("fp16_overflow", _fp16_overflow, "forward", "1", "HalfMatmul", kinds=frozenset({"+inf"}),
          op="aten.mm.default", marker="fp16"),
    Fault("nan_in_batch", _nan_in_batch, "data", "", "Sequential", tensor=TensorRef.argument("input[0]")),
    Fault("tuple_output", _tuple_output, "forward", "1", "TwoHeads", tensor=TensorRef.output("output[1]"),
          op="aten.sqrt.default", marker="tuple"),
    Fault("dict_output", _dict_output, "forward", "1", "DictHeads", tensor=TensorRef.output("output['logits']"),
          kinds=frozenset({"nan", "+inf", "-inf"}), op="aten.div.Tensor", marker="dict"),
    Fault("called_twice", _called_twice, "forward", "scale", "Scale", kinds=frozenset({"+inf", "-inf"}),
          op="aten.mul.Tensor", marker="twice", extra={"call_of_module": 2}),
    Fault("shared_submodule", _shared, "forward", "act", "LogLayer", op="aten.log.default", marker="log",
          extra={"call_of_module": 2}),
]
