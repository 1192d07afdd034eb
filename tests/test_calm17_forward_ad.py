"""Forward-mode AD in healthy loops stays calm and bit-identical in the five modes (issue 25; harness:
test_calm16.py's ``assert_calm``): a PINN whose Laplacian is ``vmap(hessian(...))`` (``jacfwd`` over ``jacrev``),
a Jacobian penalty by ``jacfwd``, "gradients without backprop" (``torch.func.jvp`` with a random tangent, the
directional derivative times the tangent written to ``.grad``), and dual numbers by ``torch.autograd.forward_ad``.

Found by calm17: forward-mode AD makes its zero tangents with ``aten._efficientzerotensor``, a tensor with no
storage; the op tracer (``ops=True``) summed it to check it was finite, and that sum, inside
``__torch_dispatch__``, read a null pointer: the kernel died with a segmentation fault (ops and ops+defer; the
other modes never read op outputs). The tracer now leaves those zeros unread (hot/reads.is_checkable_op_value).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from IPython.utils.capture import capture_output
from test_calm16 import Loop, assert_calm, same
from torch import nn
from torch.func import functional_call, hessian, jacfwd, jvp, vmap
from torch.nn import functional as F
from watching import FIVE_MODES

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _net(d_in: int = 2, d_out: int = 1) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Linear(16, d_out))


def pinn_laplacian() -> Loop:
    """Poisson's equation: the residual of -Laplace(u) = f, the Laplacian the trace of ``vmap(hessian(u))``."""
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    points = [torch.rand(16, 2) for _ in range(3)]

    def u(xi: torch.Tensor) -> torch.Tensor:
        return model(xi[None])[0, 0]

    def run() -> list[torch.Tensor]:
        out = []
        for x in points:
            laplacian = vmap(hessian(u))(x).diagonal(dim1=1, dim2=2).sum(-1)
            f = 2 * math.pi**2 * torch.sin(math.pi * x[:, 0]) * torch.sin(math.pi * x[:, 1])
            boundary = torch.cat([torch.rand(8, 1), torch.zeros(8, 1)], 1)
            loss = (laplacian + f).pow(2).mean() + model(boundary).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
        return out

    return Loop((model, opt), (model, opt), run)


def jacfwd_penalty() -> Loop:
    model = _net(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(3)]

    def run() -> list[torch.Tensor]:
        out = []
        for x, y in data:
            jac = vmap(jacfwd(lambda xi: model(xi[None])[0]))(x)
            loss = F.cross_entropy(model(x), y) + 0.1 * jac.pow(2).sum((1, 2)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
        return out

    return Loop((model, opt), (model, opt), run)


def forward_gradient() -> Loop:
    """Baydin et al.'s forward gradient: one jvp along a random direction v, (grad . v) v as the gradient."""
    model = _net(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(3)]

    def run() -> list[torch.Tensor]:
        out = []
        for x, y in data:
            params = {k: v.detach() for k, v in model.named_parameters()}
            tangents = {k: torch.randn_like(v) for k, v in params.items()}

            def loss_of(p: dict, x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                return F.cross_entropy(functional_call(model, p, (x,)), y)

            loss, directional = jvp(loss_of, (params,), (tangents,))
            for name, p in model.named_parameters():
                p.grad = directional * tangents[name]
            opt.step()
            out += [loss, directional]
        return out

    return Loop((model, opt), (model, opt), run)


def dual_numbers() -> Loop:
    """A smoothness penalty: the derivative of the output along a random input direction, by dual numbers."""
    model = _net(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]

    def run() -> list[torch.Tensor]:
        out = []
        for x, y in data:
            with fwAD.dual_level():
                dual = fwAD.make_dual(x, torch.randn_like(x))
                pred = model(dual)
                primal, tangent = fwAD.unpack_dual(pred)
            loss = F.mse_loss(primal, y) + 0.01 * tangent.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
        return out

    return Loop((model, opt), (model, opt), run)


FORWARD_AD = {
    "pinn-laplacian-vmap-hessian": pinn_laplacian,
    "jacfwd-penalty": jacfwd_penalty,
    "forward-gradient-jvp": forward_gradient,
    "dual-numbers-forward-ad": dual_numbers,
}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", FORWARD_AD)
def test_forward_mode_ad_in_a_loop_is_calm_and_identical(name: str, options: dict) -> None:
    assert_calm(FORWARD_AD[name], options)


def test_forward_mode_ad_really_makes_efficient_zero_tensors() -> None:
    """The case above is not moot: a jvp of a linear layer makes ``_efficientzerotensor`` tangents."""
    from torch.utils._python_dispatch import TorchDispatchMode

    made = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            made.append(func.__name__)
            return func(*args, **(kwargs or {}))

    layer = nn.Linear(2, 1)
    with Spy():
        jacfwd(lambda xi: layer(xi[None])[0, 0])(torch.randn(2))
    assert any(name.startswith("_efficientzerotensor") for name in made), made


CELL = """
import torch
from torch import nn
from torch.func import hessian, vmap
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
result = []
for step in range(3):
    x = torch.rand(8, 2)
    lap = vmap(hessian(lambda xi: net(xi[None])[0, 0]))(x).diagonal(dim1=1, dim2=2).sum(-1)
    loss = (lap + 1.0).pow(2).mean() + net(torch.zeros(1, 2)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    result.append(loss.detach())
"""


@pytest.mark.parametrize("flags", ["--ops", "--ops --defer"])
def test_a_notebook_cell_taking_a_hessian_under_nantrace_ops_runs_as_unwatched(ip, flags: str) -> None:
    with capture_output():
        assert ip.run_cell(CELL).error_in_exec is None
    expected = ip.user_ns["result"]
    ip.user_ns.pop("_nan_report", None)
    with capture_output() as captured:
        outcome = ip.run_cell(f"%%nantrace {flags}\n{CELL}")
    assert outcome.error_in_exec is None and ip.user_ns.get("_nan_report") is None, captured.stdout
    assert all(same(a, b) for a, b in zip(ip.user_ns["result"], expected, strict=True))
