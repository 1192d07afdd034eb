"""A bad batch made in a Dataset's __getitem__: its samples fetched again name the op and line (replay/samples.py)."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch
from faults import marked_line
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.patches.registry import installed


class Jittered(Dataset):
    """Rows standardised after a random jitter (an augmentation); row 21 is constant, so its std is zero."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(32, 4, generator=generator), torch.randn(32, 1, generator=generator)
        self.x[21] = 3.0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.x[i] + (0.0 if i == 21 else 0.01 * torch.rand(1).item() + random.random())
        return (row - row.mean()) / row.std(), self.y[i]  # producer: jittered


class Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in range(4):
            row = torch.full((4,), 3.0) if i == 2 else torch.randn(4)
            yield (row - row.mean()) / row.std(), torch.zeros(1)  # producer: stream


def train(loader: DataLoader) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for features, labels in loader:
        loss = F.mse_loss(model(features), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def here(report: nan_magic.Report) -> tuple[str, int] | None:
    return None if report.source is None else (os.path.basename(report.source.filename), report.source.lineno)


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "defer"])
def test_a_shuffled_batch_from_a_worker_is_fetched_again_at_its_step(defer: bool) -> None:
    def loader() -> DataLoader:
        return DataLoader(Jittered(), batch_size=8, shuffle=True, num_workers=1,
                          generator=torch.Generator().manual_seed(1))

    bad = next(step for step, (features, _) in enumerate(loader()) if features.isnan().any())
    assert bad > 0
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(defer=defer):
        train(loader())
    report = caught.value.report
    assert (report.phase, report.step, report.op) == ("data", bad, "aten.div.Tensor")
    assert here(report) == ("test_samples.py", marked_line("jittered", where=sys.modules[__name__]))
    assert any("fetching the batch's samples from Jittered again" in note for note in report.notes)


def test_fetching_again_leaves_the_loader_and_the_generators_as_they_were() -> None:
    def run() -> tuple[nn.Module, torch.Tensor, object]:
        random.seed(5)
        loader = DataLoader(Jittered(), batch_size=8)
        model = train(loader)
        return model.weight.detach().clone(), torch.get_rng_state(), random.getstate()

    expected = run()
    with nan_magic.watch(on_detect="log") as w:
        got = run()
    assert w.report is not None and w.report.op == "aten.div.Tensor"
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got[1], expected[1]) and got[2] == expected[2]
    assert installed() == []


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "defer"])
def test_an_iterable_dataset_in_a_worker_is_said_in_one_line(defer: bool) -> None:
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(defer=defer):
        train(DataLoader(Stream(), batch_size=2, num_workers=1))
    report = caught.value.report
    assert (report.phase, report.step, report.op) == ("data", 1, None)
    assert any("Stream, an iterable dataset: its samples cannot be fetched again" in note for note in report.notes)


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "defer"])
def test_an_iterable_dataset_iterated_in_the_loop_s_process_is_named_at_its_line(defer: bool) -> None:
    # Its __iter__ runs as the loop's data code, which the watch records (the deferred mode holds the records
    # until its check judges the batch).
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(defer=defer):
        train(DataLoader(Stream(), batch_size=2))
    report = caught.value.report
    assert (report.phase, report.step, report.op) == ("data", 1, "aten.div.Tensor")
    assert here(report) == ("test_samples.py", marked_line("stream", where=sys.modules[__name__]))


def test_a_value_stored_in_the_dataset_is_said_to_be_stored() -> None:
    x = torch.randn(16, 4)
    x[9, 2] = float("nan")
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(mode="full"):
        train(DataLoader(TensorDataset(x, torch.zeros(16, 1)), batch_size=4))
    report = caught.value.report
    assert (report.phase, report.step, report.op) == ("data", 2, None)
    assert any("from TensorDataset again made no non-finite value: it is stored in the dataset" in note
               for note in report.notes)
