"""hunt_s28c's loaders with worker processes, where the code that made a bad batch ran in another process.

A ``collate_fn`` that standardises each feature over the batch (``(x - x.mean(0)) / x.std(0)``), run by two workers,
over a batch where one feature has a single value; an ``IterableDataset`` sharded across two workers with
``get_worker_info`` (each streams every other record), whose log of a count of 0 is in worker 1's third batch. Each
with its twin, silent and bit-identical in every mode.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from contract import Case, Expect, Scenario
from contract.loops import loader_loop as _loader_loop


def _regressor() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


# ---------------------------------------------------------------- a collate_fn standardising features, in workers
def _standardise_batch(batch: list[tuple[torch.Tensor, torch.Tensor]], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.stack([x for x, _ in batch]), torch.stack([y for _, y in batch])
    return (x - x.mean(0)) / (x.std(0) + eps), y  # producer: collate standardise


def _collate_in_workers(eps: float) -> Scenario:
    """Batch 3 (worker 1's second) holds four records whose feature 1 is the same default value 2.0 (a form field
    left at its default): its std over the batch is 0. The twin adds an eps."""
    torch.manual_seed(0)
    data = [(torch.randn(4), torch.randn(1)) for _ in range(24)]
    for x, _ in data[12:16]:
        x[1] = 2.0
    loader = DataLoader(data, batch_size=4, num_workers=2, collate_fn=lambda batch: _standardise_batch(batch, eps))
    return _loader_loop(_regressor(), loader, F.mse_loss)


# ---------------------------------------------------------------- an IterableDataset sharded across two workers
class ShardedCounts(IterableDataset):
    """Records of counts, each worker streaming every other one (``get_worker_info``), as log counts."""

    def __init__(self, floor: float) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.counts = torch.randint(1, 40, (32, 4), generator=gen).float()
        self.counts[21, 2] = 0.0
        self.targets, self.floor = torch.randn(32, 1, generator=gen), floor

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, 32, workers):
            yield torch.log(self.counts[i] + self.floor), self.targets[i]  # producer: shard log


def _sharded(floor: float) -> Scenario:
    """Record 21 is worker 1's eleventh, in its third batch of 4: batch 5 as the two workers alternate. The twin
    takes ``log1p``."""
    torch.manual_seed(0)
    loader = DataLoader(ShardedCounts(floor), batch_size=4, num_workers=2)
    return _loader_loop(_regressor(), loader, F.mse_loss)


CASES = [
    Case("hunt_s28c_collate_fn_standardises_a_feature_of_one_value_in_two_workers", lambda: _collate_in_workers(0.0),
         Expect("data", "", "Sequential", step=3, op="aten.div.Tensor", marker="collate standardise",
                cause="division-by-zero")),
    Case("hunt_s28c_collate_fn_standardises_with_eps_in_two_workers_healthy", lambda: _collate_in_workers(1e-6), None),
    Case("hunt_s28c_iterable_dataset_sharded_over_two_workers_log_of_a_count_of_0", lambda: _sharded(0.0),
         Expect("data", "", "Sequential", step=5, op="aten.log.default", marker="shard log", cause="log-domain"),
         marks=(pytest.mark.xfail(strict=True, reason=(
             "an IterableDataset's samples cannot be fetched again: localize/replay/samples.py Samples.refetch "
             "returns the 'iterable-dataset' note (no indices; a worker's shard and position in its stream are not "
             "known), so every mode names the batch (data, step 5) but no op, line or log-domain cause")),)),
    Case("hunt_s28c_iterable_dataset_sharded_over_two_workers_log1p_healthy", lambda: _sharded(1.0), None),
]
