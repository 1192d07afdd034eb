"""The benchmark models run as the benchmarks run them: GPT-2 under bfloat16 autocast, watched and not."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import nan_magic

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import models  # benchmarks/ holds scripts, not a package: imported from its path

TINY = models.GPT2Config(layers=2, hidden=32, heads=4, ffn=64, vocab=128, seq=16)


def _trained(watched: bool, steps: int = 3) -> tuple[models.Benchmark, nan_magic.Watch | None]:
    torch.manual_seed(0)
    bench = models.gpt2_benchmark(torch.device("cpu"), TINY, batch=2, autocast=torch.bfloat16, name="tiny")
    bench.model.train()
    if not watched:
        for _ in range(steps):
            bench.train_step()
        return bench, None
    with nan_magic.watch(bench.model) as w:
        for _ in range(steps):
            bench.train_step()
    return bench, w


def test_gpt2_under_bf16_autocast_is_silent_and_trains_exactly_as_unwatched() -> None:
    # The GPU table's GPT-2 small, shrunk: bf16 autocast, a -inf causal mask, dropout.
    watched, w = _trained(True)
    unwatched, _ = _trained(False)
    assert w is not None and w.report is None and w.events == []
    assert w.steps_taken == 3
    for (name, a), (_, b) in zip(watched.model.named_parameters(), unwatched.model.named_parameters()):
        assert torch.equal(a, b), name
    assert "bfloat16 autocast" in watched.description


def test_gpt2_small_is_listed_by_default_only_on_a_gpu() -> None:
    assert models.default_models("cpu") == ["mlp", "resnet18", "bert", "gpt2"]
    assert models.default_models("cuda") == ["mlp", "resnet18", "bert", "gpt2", "gpt2_small"]
    assert models.GPT2_SMALL.layers == 12 and models.GPT2_SMALL.hidden == 768 and models.GPT2_SMALL.seq == 512
