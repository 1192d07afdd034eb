"""The benchmark models run as the benchmarks run them: GPT-2 under bfloat16 autocast, watched and not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import nan_magic

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import hot_calls  # benchmarks/ holds scripts, not a package: imported from its path
import models

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


def _hot_calls(*arguments: str) -> subprocess.CompletedProcess[str]:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "hot_calls.py"
    env = {**os.environ, "PYTHONPATH": str(script.parent.parent)}
    return subprocess.run([sys.executable, str(script), *arguments], capture_output=True, text=True, env=env,
                          timeout=300, check=False)


def test_hot_calls_counts_the_calls_the_watch_adds_to_a_step_and_names_our_functions() -> None:
    result = _hot_calls("--models", "small_cnn", "--steps", "5", "--top", "3")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    row = next(line for line in lines if line.startswith("small_cnn"))
    _name, module_calls, extra, ours, per_call, floor = row.split()
    assert int(module_calls) == 20  # as launch_bound.py counts them: a global pre-hook over one step
    assert int(ours) > 0 and float(extra) >= float(ours)  # ours are among every call added
    # extra is printed rounded to a whole call, per_call from the unrounded mean: they agree to a rounding.
    assert abs(float(per_call) - float(extra) / 20) <= 0.5 / 20 + 0.05
    assert 0 < float(floor) < float(extra)  # the tier-1 reads alone cost calls too, fewer than the watch
    top = lines[lines.index(row) + 1 : lines.index(row) + 4]
    assert all("nan_magic" not in line and ".py:" in line for line in top)  # module:function of ours


def test_hot_calls_refuses_a_step_count_below_one_in_one_line() -> None:
    result = _hot_calls("--steps", "0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("--steps must be at least 1, not 0")


def test_hot_calls_passes_a_watch_option_and_says_so_and_refuses_defer_among_them() -> None:
    # (issue 25, hot21: replay=False counted against the default; the value is a Python literal)
    result = _hot_calls("--models", "small_cnn", "--steps", "3", "--option", "replay=False", "--option", "mode=full")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].endswith("replay=False, mode='full'")
    refused = _hot_calls("--option", "defer=True")
    assert refused.returncode == 2
    assert "--option takes NAME=VALUE (not defer: use --defer), not 'defer=True'" in refused.stderr.splitlines()[-1]


def test_hot_calls_counts_what_each_idiom_of_a_realistic_loop_adds_in_both_modes() -> None:
    result = _hot_calls("--idioms", "--steps", "4")
    assert result.returncode == 0, result.stderr
    names = ["minimal", *hot_calls.IDIOMS, "all"]
    rows = {cells[0]: cells[1:5] for cells in map(str.split, result.stdout.splitlines()) if cells and cells[0] in names}
    assert list(rows) == names  # one row per idiom, in order
    assert rows["minimal"][1] == rows["minimal"][3] == "0"  # the minimal loop adds nothing to itself
    # Clipping runs ops in the update region, which both modes watch; a loss.item() logged after the step is let
    # by unrecorded: it costs less than one of the four ops the accuracy metric records.
    for column in (1, 3):
        assert int(rows["clip"][column]) > 0
        assert 0 <= int(rows["item"][column]) < int(rows["metric"][column]) / 4


def test_launch_bound_times_the_deferred_watch_as_its_nan_magic_column_and_says_so() -> None:
    # The CPU stand-in for the CUDA path's host cost: the same table, the watch deferred (defer=True).
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "launch_bound.py"
    env = {**os.environ, "PYTHONPATH": str(script.parent.parent)}
    result = subprocess.run(
        [sys.executable, str(script), "--models", "small_cnn", "--rounds", "1", "--budget", "0.2", "--warmup", "1",
         "--defer"], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert "the watch deferred (defer=True)" in result.stdout
    row = next(line for line in result.stdout.splitlines() if line.startswith("small_cnn"))
    assert "nan_magic defer ratio" in result.stdout and "isnan hook ratio" in result.stdout
    ratio = float(row.split()[3].split("±")[0])  # model, calls, unwatched ms, then the deferred watch's ratio
    assert 0.5 < ratio < 5.0


def test_event_latency_times_the_failing_step_and_says_what_the_report_named() -> None:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "event_latency.py"
    env = {**os.environ, "PYTHONPATH": str(script.parent.parent)}
    result = subprocess.run(
        [sys.executable, str(script), "--models", "mlp", "--modes", "default", "defer", "--warm", "1", "--timed", "1"],
        capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    rows = [line.split(maxsplit=5) for line in result.stdout.splitlines() if line.startswith("mlp")]
    assert [row[1] for row in rows] == ["default", "defer"]
    for _model, _mode, healthy, event, ratio, named in rows:
        assert float(healthy) > 0 and float(event) > 0 and float(ratio) > 0
        # The layer halfway down, whose output the script scaled by inf, and the op that did it.
        layer = named.split()[0]
        assert f"{layer} scaled by inf: forward {layer} (Linear), aten.mul.Tensor" in named
