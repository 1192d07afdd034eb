"""Gaps found by the hunt-s30 sweep: what the user sees of a graph model given a sparse adjacency.

A sparse COO tensor that holds an inf (``D^-1/2`` of a node of degree 0) is the
batch's data: every timing names it there, and the report's remedies are tried
(the eps verified; leaving samples out is said not to apply, a sparse tensor has
no rows that are samples), never lost to an error of an op sparse tensors lack.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic import NonFiniteError

MODES = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred"),
         pytest.param({"mode": "full"}, id="full"), pytest.param({"ops": True}, id="ops")]


class GCN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(adj, self.l2(torch.sparse.mm(adj, self.l1(x)).relu()))


def adjacency(edges: torch.Tensor, n: int) -> torch.Tensor:
    a = torch.sparse_coo_tensor(edges, torch.ones(edges.shape[1]), (n, n)).coalesce()
    inv_sqrt = torch.sparse.sum(a, 1).to_dense().pow(-0.5)  # degree 0: inf
    i = a.indices()
    return torch.sparse_coo_tensor(i, inv_sqrt[i[0]] * a.values() * inv_sqrt[i[1]], (n, n))


def train(options: dict) -> NonFiniteError:
    torch.manual_seed(0)
    model = GCN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    graphs = [torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 0]]), torch.tensor([[0, 1, 1, 2, 3], [1, 0, 2, 1, 4]])]
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for edges in graphs:
            loss = F.cross_entropy(model(x, adjacency(edges, 5)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return caught.value


@pytest.mark.parametrize("options", MODES)
def test_an_inf_in_a_sparse_adjacency_is_named_as_the_data_at_its_pow(options: dict) -> None:
    report = train(options).report
    assert (report.phase, report.module, report.step, report.op) == ("data", "", 1, "aten.pow.Tensor_Scalar")
    assert report.source is not None and report.source.line.endswith("# degree 0: inf")
    assert (report.nan, report.posinf) == (0, 1)


def test_the_remedies_of_a_sparse_adjacency_are_tried_not_lost() -> None:
    report = train({}).report
    assert not [note for note in report.note_facts if note.kind == "fixes-failed"]
    kinds = {trial.kind: trial for trial in report.fixes}
    assert kinds["eps"].finite is True
    assert kinds["skip-batch"].untried is not None and "sparse" in kinds["skip-batch"].untried


# ------------------------------------------------ hunt-s30b: what the review of hunt-s30 found
ALL_MODES = [*MODES, pytest.param({"ops": True, "defer": True}, id="ops-defer")]


class MeshNet(nn.Module):
    """Per-sample features smoothed over a fixed mesh by its sparse Laplacian, given as an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.head = nn.Linear(6, 6), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, lap: torch.Tensor) -> torch.Tensor:
        return self.head(torch.sparse.mm(lap, self.l1(x).T).T.relu())


def laplacian(n: int) -> torch.Tensor:
    i = torch.arange(n)
    edges = torch.stack([torch.cat([i, i]), torch.cat([i, (i + 1) % n])])
    return torch.sparse_coo_tensor(edges, torch.cat([torch.full((n,), 2.0), -torch.ones(n)]), (n, n)).coalesce()


@pytest.mark.parametrize("options", ALL_MODES)
def test_a_bad_sample_beside_a_sparse_laplacian_is_left_out_verified(options: dict) -> None:
    torch.manual_seed(0)
    model = MeshNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    lap, raw, ys = laplacian(6), torch.rand(2, 8, 6) + 0.5, torch.randn(2, 8, 1)
    raw[1, 5, 2] = 0.0
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(2):
            x = torch.log(raw[step])  # data code: log of a zero reading
            loss = F.mse_loss(model(x, lap), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.step, report.op, report.neginf) == ("data", 1, "aten.log.default", 1)
    skip = {trial.kind: trial for trial in report.fixes}["skip-batch"]
    assert (skip.untried, skip.finite) == (None, True)
    assert (dict(skip.facts)["dropped"], dict(skip.facts)["batch"]) == ((5,), 8)
    assert lap.layout is torch.sparse_coo and lap._nnz() == 12  # the user's Laplacian is left whole


class BiasedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.T + bias.to_dense()
        return torch.softmax(scores, -1) @ x  # attention softmax


def attend(options: dict, layout: torch.layout, masked: list[list[int]]) -> nan_magic.Watch:
    torch.manual_seed(0)
    model = BiasedAttention()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(3, 4)
    with nan_magic.watch(model, opt, **options) as watch:
        for step in range(2):
            index = torch.tensor([[0, 1], [1, 2]]) if step == 0 else torch.tensor(masked)
            bias = torch.sparse_coo_tensor(index, torch.full((index.shape[1],), -math.inf), (3, 3))
            bias = bias.to_sparse_csr() if layout is torch.sparse_csr else bias
            loss = model(x, bias).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return watch


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
@pytest.mark.parametrize("options", ALL_MODES)
def test_a_sparse_minus_inf_attention_bias_is_a_mask_not_an_alarm(options: dict, layout: torch.layout) -> None:
    watch = attend(options, layout, [[0, 2], [2, 1]])
    assert watch.report is None
    assert [(event.phase, event.benign) for event in watch.events][:1] == [("data", True)]


@pytest.mark.parametrize("options", ALL_MODES)
def test_a_sparse_bias_masking_a_whole_row_names_the_softmax(options: dict) -> None:
    with pytest.raises(NonFiniteError) as caught:
        attend(options, torch.sparse_coo, [[0, 0, 0], [0, 1, 2]])
    report = caught.value.report
    assert (report.phase, report.step, report.op, report.nan) == ("forward", 1, "aten._softmax.default", 3)
    assert report.cause is not None and report.cause.label == "masked-softmax"
    assert report.source is not None and report.source.line.endswith("# attention softmax")


class Flow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.full((3, 3), 0.3))

    def forward(self, h: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        return h @ torch.linalg.matrix_exp(self.A * dt).T  # flow


@pytest.mark.parametrize("options", ALL_MODES)
def test_matrix_exp_of_small_entries_and_a_large_norm_is_an_exp_overflow(options: dict) -> None:
    torch.manual_seed(0)
    model = Flow()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for dt in (1.0, 111.0):  # entries about 34, far below exp's 88.72; the norm about 102 is not
            loss = model(torch.randn(2, 3), torch.tensor(dt)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.step, report.op) == ("forward", 1, "aten.linalg_matrix_exp.default")
    assert report.cause is not None and (report.cause.label, report.cause.reading) == (
        "exp-overflow", "matrix-exp-overflow")
    hint = report.cause.hint
    assert "norm passes about 88.72" in hint and "over 3 columns" in hint and "entries pass" not in hint
    assert 100 < report.cause.fact("bound") < 110  # 3 x |entry| of about 34: the largest absolute row sum
    assert "float64" in hint and "tried" not in hint
