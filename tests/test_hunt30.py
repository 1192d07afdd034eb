"""Gaps found by the hunt-s30 sweep: what the user sees of a graph model given a sparse adjacency.

A sparse COO tensor that holds an inf (``D^-1/2`` of a node of degree 0) is the
batch's data: every timing names it there, and the report's remedies are tried
(the eps verified; leaving samples out is said not to apply, a sparse tensor has
no rows that are samples), never lost to an error of an op sparse tensors lack.
"""

from __future__ import annotations

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
