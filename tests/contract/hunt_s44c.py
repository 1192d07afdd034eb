"""hunt_s44c, a model given a numpy batch, which its own ``forward`` converts, in every mode.

A scikit-learn-style wrapper: ``model(x)`` with ``x`` a numpy array (or a dict of them), made a tensor by
``torch.as_tensor`` inside the model's ``forward``. A NaN the array brought in (a missing value in the table) was
reported as the root's own forward, op None, cause unclassified, in every mode: no tensor entered the model, so
nothing was read as its batch. Given by keyword (``model(x=table)``), the per-module and op modes judged the first
child before the keyword batch, noted as the call returns: they too named the model's code. Rows: the NaN at step
2, in a plain array, in a dict of arrays, by keyword, in the 3rd of 4 accumulated micro-batches (the deferred check
reads the batch after later micro-batches ran); the healthy twins, and a model that imputes the missing values
itself (a handled batch: benign, silent). ``model(a, w=w)``, two fresh arrays a step: the keyword's array replaced
the positional one's kept tensor, freed before the deferred check read it (``1 nan of 20`` read ``0 nan``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop


class TabularNet(nn.Module):
    """An MLP over a table given as numpy; ``impute`` replaces missing values by 0 first."""

    def __init__(self, impute: bool) -> None:
        super().__init__()
        self.impute = impute
        self.fc, self.head = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: np.ndarray | dict[str, np.ndarray]) -> torch.Tensor:
        table = x["features"] if isinstance(x, dict) else x
        h = torch.as_tensor(table, dtype=torch.float32)
        if self.impute:
            h = torch.nan_to_num(h, nan=0.0)
        return self.head(self.fc(h).relu())


def _tables(missing: bool, steps: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    tables = [rng.normal(size=(5, 4)) for _ in range(steps)]
    if missing:
        tables[2][1, 2] = np.nan
    return tables


def _numpy(missing: bool, impute: bool = False, as_dict: bool = False, keyword: bool = False) -> Scenario:
    """Step 2's table has a missing value (NaN); the table given by position, in a dict, or as ``model(x=...)``.
    Twins: no missing value; a model that imputes it."""
    torch.manual_seed(0)
    model = TabularNet(impute)
    tables, ys = _tables(missing), _batches(5, 1)
    if keyword:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def run() -> list[torch.Tensor]:
            losses = []
            for step in range(4):
                loss = F.mse_loss(model(x=tables[step]), ys[step])
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            return losses

        return Scenario((model, opt), run)

    def batch(step: int) -> tuple[object]:
        return ({"features": tables[step]},) if as_dict else (tables[step],)

    return sgd_loop(model, batch, lambda out, step: F.mse_loss(out, ys[step]))


def _accumulated(missing: bool) -> Scenario:
    """4 micro-batches a step, one SGD step after them; at step 1 the 3rd micro-batch has a missing value."""
    torch.manual_seed(0)
    model = TabularNet(False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    tables = [_tables(False, 4) for _ in range(3)]
    if missing:
        tables[1][2][0, 3] = np.nan
    ys = [_batches(5, 1) for _ in range(3)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            opt.zero_grad()
            for micro in range(4):
                loss = F.mse_loss(model(tables[step][micro]), ys[step][micro]) / 4
                loss.backward()
                losses.append(loss.detach())
            opt.step()
        return losses

    return Scenario((model, opt), run)


class WeightedTabularNet(TabularNet):
    """A table and its per-cell weights, both numpy, the weights by keyword."""

    def forward(self, x: np.ndarray, w: np.ndarray | None = None) -> torch.Tensor:  # type: ignore[override]
        weights = torch.as_tensor(w, dtype=torch.float32)
        return self.head(self.fc(torch.as_tensor(x, dtype=torch.float32) * weights).relu())


def _positional_and_keyword(missing: bool) -> Scenario:
    """``model(a, w=w)``, both arrays made fresh each step (the loop keeps none); NaN in ``a`` at step 2."""
    torch.manual_seed(0)
    model = WeightedTabularNet(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rng, ys = np.random.default_rng(0), _batches(5, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            table, weights = rng.normal(size=(5, 4)), np.ones((5, 4))
            if step == 2 and missing:
                table[0, 3] = np.nan
            loss = F.mse_loss(model(table, w=weights), ys[step])
            del table, weights
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


#: A numpy batch holds no rows skip-batch can leave out: the note says so (not that no model call was given it).
_UNSLICED = (("default", "skip-batch cannot leave out"), ("defer", "skip-batch cannot leave out"))
_DATA = Expect("data", "", "TabularNet", step=2, op=None, kinds=frozenset({"nan"}), cause="bad-input-data",
               says=_UNSLICED)

CASES = [
    Case("hunt_s44_numpy_batch_missing_value_is_data", lambda: _numpy(True), _DATA),
    Case("hunt_s44_numpy_dict_batch_missing_value_is_data", lambda: _numpy(True, as_dict=True), _DATA),
    Case("hunt_s44_numpy_batch_by_keyword_missing_value_is_data", lambda: _numpy(True, keyword=True), _DATA),
    Case("hunt_s44_numpy_batch_healthy", lambda: _numpy(False), None),
    Case("hunt_s44_numpy_batch_by_keyword_healthy", lambda: _numpy(False, keyword=True), None),
    Case("hunt_s44_numpy_batch_imputed_by_the_model_healthy", lambda: _numpy(True, impute=True), None),
    Case("hunt_s44_numpy_batch_third_micro_batch_missing_value", lambda: _accumulated(True),
         Expect("data", "", "TabularNet", step=1, op=None, kinds=frozenset({"nan"}), cause="bad-input-data",
                says=_UNSLICED)),
    Case("hunt_s44_numpy_batch_accumulated_healthy", lambda: _accumulated(False), None),
    Case("hunt_s44_numpy_positional_and_keyword_fresh_arrays_counts", lambda: _positional_and_keyword(True),
         Expect("data", "", "WeightedTabularNet", step=2, op=None, kinds=frozenset({"nan"}), cause="bad-input-data",
                says=tuple((mode, "input[0] in data step 2: WeightedTabularNet (root) (1 nan of 20)")
                           for mode in ("default", "defer", "full", "ops")))),
    Case("hunt_s44_numpy_positional_and_keyword_fresh_arrays_healthy", lambda: _positional_and_keyword(False), None),
]
