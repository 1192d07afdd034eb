"""Values the watch must read in every layout, and values it must leave alone without crashing.

Complex tensors are read through their real view, sparse ones through their
stored values (issue 15, item 7); nested, meta and dispatching-subclass
tensors are skipped and counted, and the user's code runs exactly as
unwatched (item 12).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from contract import Case, Expect, Scenario

# -- complex ---------------------------------------------------------------------------------


class ComplexLog(nn.Module):
    """``log`` of a complex zero is ``-inf+0j``: the producer, though only its real part is bad."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.complex(x, torch.zeros_like(x))
        return torch.log(z)  # producer: complex log


class ComplexThenReal(nn.Module):
    """The complex producer, then a Linear on its real part (which a watch blind to complex would blame)."""

    def __init__(self) -> None:
        super().__init__()
        self.spectrum = ComplexLog()
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.spectrum(x).real)


def _complex_log() -> Scenario:
    torch.manual_seed(0)
    model = ComplexThenReal()
    x = torch.rand(3, 4) + 0.5
    x[1, 2] = 0.0
    return Scenario((model,), lambda: model(x))


class SpectralDivide(nn.Module):
    """Divides a signal's spectrum by a filter's; a zero in the filter's spectrum makes inf and NaN."""

    def forward(self, signal: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(signal)
        spectrum /= torch.fft.rfft(kernel)  # producer: spectral division
        return spectrum


class Deconvolve(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.divide = SpectralDivide()
        self.mix = nn.Linear(8, 8, dtype=torch.complex64)

    def forward(self, signal: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        return torch.fft.irfft(self.mix(self.divide(signal, kernel=kernel)), n=14)


def _spectral_divide() -> Scenario:
    torch.manual_seed(0)
    model = Deconvolve()
    signal = torch.randn(2, 14)
    kernel = torch.zeros(2, 14)  # an all-zero filter: its spectrum is zero everywhere
    return Scenario((model,), lambda: model(signal, kernel=kernel))


class ComplexRoot(nn.Module):
    """``sqrt`` of a complex zero is finite; its gradient, ``1 / (2 sqrt(z))``, is not."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(z)  # producer: complex sqrt


class ComplexFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4, dtype=torch.complex64)
        self.root = ComplexRoot()
        self.head = nn.Linear(4, 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.head(self.root(self.pre(z)).real)


def _complex_root_backward() -> Scenario:
    torch.manual_seed(0)
    model = ComplexFeatures()
    with torch.no_grad():
        model.pre.weight.zero_()
        model.pre.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    z = torch.randn(3, 4, dtype=torch.complex64)

    def run() -> None:
        opt.zero_grad()
        model(z).sum().backward()
        opt.step()

    return Scenario((model, opt), run)


def _complex_training() -> Scenario:
    """Complex parameters, gradients and Adam state over 30 steps: nothing to report."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6, dtype=torch.complex64), nn.Linear(6, 2, dtype=torch.complex64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    z = torch.randn(16, 6, dtype=torch.complex64)
    target = torch.randn(16, 2, dtype=torch.complex64)

    def run() -> Any:
        for _ in range(30):
            loss = (model(z) - target).abs().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [parameter.detach().clone() for parameter in model.parameters()]

    return Scenario((model, opt), run)


# -- sparse ----------------------------------------------------------------------------------


class SparseLogits(nn.Module):
    """Log-scores of a sparse score matrix, kept sparse: a stored negative score gives NaN."""

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        stored = scores.to_sparse()
        logs = torch.log(stored.values())  # producer: sparse log
        return torch.sparse_coo_tensor(stored.indices(), logs, stored.shape, is_coalesced=True)


class SparseThenDense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logits = SparseLogits()
        self.head = nn.Linear(4, 2)

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return self.head(self.logits(scores).to_dense())


def _sparse_log() -> Scenario:
    torch.manual_seed(0)
    model = SparseThenDense()
    # A stored entry (nonzero) gets a log; one of them is a tiny negative score: NaN.
    scores = torch.tensor([[0.5, 0.0, 2.0, 0.0], [0.0, -1e-3, 0.0, 1.0]])
    return Scenario((model,), lambda: model(scores))


class CsrNormalise(nn.Module):
    """Normalises a CSR adjacency's stored weights by their row sums; an all-zero row divides 0 by 0."""

    def forward(self, adjacency: torch.Tensor) -> torch.Tensor:
        values = adjacency.values()
        degrees = torch.repeat_interleave(adjacency.to_dense().sum(1), adjacency.crow_indices().diff())
        return torch.sparse_csr_tensor(
            adjacency.crow_indices(), adjacency.col_indices(), values / degrees, adjacency.shape  # producer: csr
        )


class Graph(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.normalise = CsrNormalise()
        self.embed = nn.Linear(3, 3)

    def forward(self, adjacency: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.embed(self.normalise(adjacency) @ features)


def _csr_normalise() -> Scenario:
    torch.manual_seed(0)
    model = Graph()
    dense = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, -1.0], [1.0, 1.0, 0.0]])  # row 1 sums to 0
    adjacency = dense.to_sparse_csr()
    features = torch.randn(3, 3)
    return Scenario((model,), lambda: model(adjacency, features))


def _sparse_embedding_training() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Linear(8, 1))
    sparse_opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    dense_opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    tokens = torch.randint(0, 50, (30, 6), generator=torch.Generator().manual_seed(1))

    def run() -> Any:
        for step in range(30):
            loss = model(tokens[step]).pow(2).mean()
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            loss.backward()
            sparse_opt.step()
            dense_opt.step()
        return [parameter.detach().clone() for parameter in model.parameters()]

    return Scenario((model, sparse_opt, dense_opt), run)


# -- what the watch cannot read ----------------------------------------------------------------


def _padded_encoder_inference() -> Scenario:
    """The nested-tensor fast path: eval, no_grad, a padding mask (enable_nested_tensor defaults to True)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2).eval()
    x = torch.randn(3, 6, 16)
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, 4:] = True
    padding[2, 2:] = True

    def run() -> torch.Tensor:
        with torch.no_grad():
            return encoder(x, src_key_padding_mask=padding)

    return Scenario((encoder,), run)


def _meta_shapes() -> Scenario:
    """A model run on the meta device to work out shapes: no data to read."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    return Scenario((model,), lambda: tuple(model(torch.empty(5, 8, device="meta")).shape))


class Wrapped(torch.Tensor):
    """A wrapper subclass with its own ``__torch_dispatch__`` (like DTensor or a fake tensor)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapped:
        wrapped = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
        wrapped.inner = inner
        return wrapped

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in _REFUSED:
            raise RuntimeError(f"Wrapped refuses {func}")
        unwrap = lambda value: value.inner if isinstance(value, Wrapped) else value  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda value: Wrapped(value) if type(value) is torch.Tensor else value, out)


#: What a subclass might refuse: every reduction the watch could use to read it.
_REFUSED = {torch.ops.aten.aminmax, torch.ops.aten.amin, torch.ops.aten.amax, torch.ops.aten.sum,
            torch.ops.aten.isfinite, torch.ops.aten.isnan, torch.ops.aten.min, torch.ops.aten.max,
            torch.ops.aten.linalg_vector_norm, torch.ops.aten._foreach_norm}


def _dispatching_subclass() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = Wrapped(torch.randn(2, 4))

    def run() -> torch.Tensor:
        with torch.no_grad():
            return model(x).inner

    return Scenario((model,), run)


class Tagged(torch.Tensor):
    """A ``__torch_function__`` subclass (metadata tags) that refuses reductions: read through its data."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in {"aminmax", "amin", "amax", "sum", "isfinite", "isnan", "norm"}:
            raise RuntimeError(f"Tagged refuses {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


class TaggedLog(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x.as_subclass(Tagged))  # producer: tagged log


def _tagged_subclass() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), TaggedLog())
    with torch.no_grad():
        model[0].bias.fill_(-5.0)  # a negative input to the log: NaN
    x = torch.rand(2, 4)
    return Scenario((model,), lambda: model(x))


CASES = [
    Case("complex_log_of_zero", _complex_log,
         Expect("forward", "spectrum", "ComplexLog", op="aten.log.default", marker="complex log",
                kinds=frozenset({"-inf"}))),
    Case("complex_spectral_division_in_place", _spectral_divide,
         Expect("forward", "divide", "SpectralDivide", op="aten.div_.Tensor", marker="spectral division",
                kinds=frozenset({"nan", "+inf", "-inf"}))),
    Case("complex_sqrt_backward", _complex_root_backward,
         Expect("backward", "root", "ComplexRoot", op="aten.div.Tensor", marker="complex sqrt",
                op_modes=("default", "defer", "full", "ops"))),
    Case("complex_parameters_training", _complex_training, None),
    Case("sparse_coo_log", _sparse_log,
         Expect("forward", "logits", "SparseLogits", op="aten.log.default", marker="sparse log",
                kinds=frozenset({"nan"}))),
    Case("sparse_csr_zero_degree", _csr_normalise,
         Expect("forward", "normalise", "CsrNormalise", op="aten.div.Tensor", marker="csr")),
    Case("sparse_embedding_training", _sparse_embedding_training, None),
    Case("nested_fast_path_encoder", _padded_encoder_inference, None),
    Case("meta_device_shapes", _meta_shapes, None),
    Case("dispatching_subclass_refusing_reductions", _dispatching_subclass, None),
    Case("function_subclass_refusing_reductions", _tagged_subclass,
         Expect("forward", "1", "TaggedLog", op="aten.log.default", marker="tagged log",
                kinds=frozenset({"nan"}))),
]
