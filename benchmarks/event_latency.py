"""How long the cell takes to stop once a value goes non-finite: the failing step against a healthy one.

Usage::

    python benchmarks/event_latency.py                    # gpt2 and resnet18, default and deferred, ~3 minutes
    python benchmarks/event_latency.py --models mlp bert gpt2 resnet18 --modes default defer full ops

Why: the watch is nearly free until the event, then it does everything it put off: it replays the failing
step under the op tracer to name the producer, measures the tensors the report shows (its layer table, the
histograms' samples) and tries the remedies its cause suggests. A user waits for all of it before the cell
stops and the report opens. No test times it, and a report that takes a minute on a model whose step takes
a second is felt.

Method: per model and mode, a fresh copy of the model (same seed) under ``watch(model, opt, **mode)``; W
healthy steps, then K timed healthy steps (their median), then the event step: the output of a layer in the
middle of the model is multiplied by a scale, 1.0 on every step but that one, where it is inf (an op that makes
inf from finite values, named by the replay; the worst case for it: every op after it is non-finite too, and
each is looked at). The step is timed from its start until ``NonFiniteError`` is caught and the report built
(``str(report)`` included: the text a script prints). Wall time (``time.perf_counter``): the
replay and the report are work the user waits for, whatever runs beside them. The fix trials run as by default.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import pin_malloc
from models import BUILDERS, Benchmark, build

import nan_magic

MODES = {
    "default": {}, "defer": {"defer": True}, "full": {"mode": "full"}, "ops": {"ops": True},
}


def scale_middle_layer(model: torch.nn.Module) -> tuple[str, list[float]]:
    """Multiply the output of the layer halfway down the model (a Linear or a convolution) by a scale; its name
    and the scale, a one-element list the loop sets."""
    layers = [(name, module) for name, module in model.named_modules()
              if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d))]
    name, layer = layers[len(layers) // 2]
    scale = [1.0]
    forward = layer.forward
    layer.forward = lambda *args, **kwargs: forward(*args, **kwargs) * scale[0]  # producer: the event's op
    return name, scale


def measure(name: str, mode: str, warm: int, timed: int) -> tuple[float, float, str]:
    """(median healthy step s, event step s, what the report named) for ``name`` under ``mode``."""
    bench: Benchmark = build(name, "cpu")
    layer, scale = scale_middle_layer(bench.model)
    times = []
    with nan_magic.watch(bench.model, bench.optimizer, **MODES[mode]):
        for index in range(warm + timed):
            start = time.perf_counter()
            bench.train_step()
            if index >= warm:
                times.append(time.perf_counter() - start)
        scale[0] = float("inf")
        start = time.perf_counter()
        try:
            bench.train_step()
            bench.train_step()  # (a deferred check may judge the step at the next one's start)
        except nan_magic.NonFiniteError as error:
            text = str(error.report)
            event = time.perf_counter() - start
            report = error.report
            named = f"{report.phase} {report.where}, {report.op} ({len(text)} characters)"
        else:
            raise AssertionError(f"{name}: no event after {layer}'s output was scaled by inf")
    return statistics.median(times), event, f"{layer} scaled by inf: {named}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["gpt2", "resnet18"], choices=sorted(BUILDERS))
    parser.add_argument("--modes", nargs="*", default=["default", "defer"], choices=sorted(MODES))
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--timed", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    pin_malloc()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s); wall time; event step: from its start to the "
          "report built")
    print(f"{'model':<10} {'mode':<8} {'healthy step s':>15} {'event step s':>13} {'ratio':>7}  report")
    for name in args.models:
        for mode in args.modes:
            healthy, event, named = measure(name, mode, args.warm, args.timed)
            print(f"{name:<10} {mode:<8} {healthy:>15.3f} {event:>13.2f} {event / healthy:>7.1f}  {named}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
