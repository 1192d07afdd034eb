"""The watch's share of a healthy launch-bound step, sampled from outside: a ratio that holds on a busy machine.

Usage (needs py-spy: ``pip install -e ".[bench]"``)::

    python benchmarks/hot_share.py                 # the three launch-bound models, ~1.5 minutes
    python benchmarks/hot_share.py --defer         # the deferred mode (defer=True, CUDA's default)
    python benchmarks/hot_share.py --top 10        # and the functions of ours the samples landed in most
    python benchmarks/hot_share.py --top 10 --by entry   # ... by the hook of ours torch called
    python benchmarks/hot_share.py --option replay=False --option fixes=False   # any watch() option, as a literal

Why: launch_bound.py times the watched and the unwatched step one after the other; on a
shared machine the two move by 10-40% between blocks, more than the watch's cost. py-spy
samples the running process's Python stack from outside (1,000 times a second), so a
sample lands in the watch's code in proportion to the time the process spends there,
whatever else runs on the machine: the share is steady where the timings are not.
``ratio`` is what the share means for the step, ``1 / (1 - share)``: the step's time with
the watch over its time without, if the watch's code were all it added.

What counts as the watch's: a sample whose innermost frame of nan_magic sits above the
training step, except the ``Tensor.backward`` wrapper while autograd runs under it (the
user's backward; gradient hooks of ours inside it count), the ``zero_grad`` wrapper (and
``call_aside``, patches/registry.py, which calls it) while torch's ``zero_grad`` runs under it,
and the loss-code recorder's ``__torch_dispatch__`` while a torch function runs under it. Time in C is attributed to the
Python frame that called it, so the ops the recorder runs for the user (it calls them from
its own frame) count as ours: the share slightly overstates the recorder.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time

SETTLE = 60
RATE = 1000


def child(name: str, seconds: float, defer: bool, options: dict[str, object]) -> None:
    """Train ``name`` under the watch for ``seconds`` after settling (what py-spy samples)."""
    import torch
    from models import build_launch_bound

    import nan_magic

    torch.set_num_threads(1)
    bench = build_launch_bound(name)
    with nan_magic.watch(bench.model, bench.optimizer, defer=defer, **options):
        for _ in range(SETTLE):
            bench.train_step()
        print("settled", flush=True)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            bench.train_step()


def share(raw: str, by_entry: bool = False) -> tuple[int, collections.Counter[str]]:
    """Samples inside the training step, and those of ours by innermost function, from py-spy's raw output.

    ``by_entry``: by the outermost function of ours instead (the hook or callback torch called: the
    watch's cost per entry point), the wrappers around the user's own calls passed over.
    """
    steps = 0
    ours: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _space, count = line.rpartition(" ")
        frames = stack.split(";")
        # (py-spy names a method with its class: "Benchmark.train_step (models.py:84)")
        start = next((index for index, frame in enumerate(frames) if frame.partition(" (")[0].endswith("train_step")),
                     None)
        if start is None:
            continue
        steps += int(count)
        function = _innermost_of_ours(frames[start:])
        if function is not None:
            ours[_outermost_of_ours(frames[start:]) if by_entry else function] += int(count)
    return steps, ours


#: The wrappers of ours around a user's call (their own frames are the user's call, seen from inside).
_WRAPPERS = ("patches/backward.py", "patches/zero_grad.py", "patches/registry.py")


def _outermost_of_ours(frames: list[str]) -> str:
    for frame in frames:
        function, _paren, where = frame.partition(" (")
        if "nan_magic/" in where and not any(wrapper in where for wrapper in _WRAPPERS):
            return f"{where.split('nan_magic/')[-1].split(':')[0]}:{function}"
    return "(a wrapper's own frames)"


def _innermost_of_ours(frames: list[str]) -> str | None:
    for index in range(len(frames) - 1, -1, -1):
        frame = frames[index]
        if "nan_magic/" not in frame:
            continue
        function, _paren, where = frame.partition(" (")
        below = index < len(frames) - 1
        if below and (function.endswith("__torch_dispatch__") or any(wrapper in where for wrapper in _WRAPPERS)):
            # The user's op, backward or zero_grad runs under ours (zero_grad's from registry.py's call_aside: until
            # the fifteenth round counted as ours, 1.6% of a deep_mlp step, "a wrapper's own frames" by entry).
            return None
        return f"{where.split('nan_magic/')[-1].split(':')[0]}:{function}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=["tiny_lm", "deep_mlp", "small_cnn"],
                        choices=["tiny_lm", "deep_mlp", "small_cnn"])
    parser.add_argument("--seconds", type=float, default=25.0, help="seconds sampled per model (default 25)")
    parser.add_argument("--defer", action="store_true", help="the deferred mode (defer=True, CUDA's default)")
    parser.add_argument("--top", type=int, default=0, help="list the N functions of ours sampled most")
    parser.add_argument("--by", choices=["function", "entry"], default="function",
                        help="--top by the innermost function of ours (default), or by the entry point: the hook or "
                             "callback of ours that torch called")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="pass NAME=VALUE to watch() (VALUE a Python literal, e.g. replay=False); repeatable")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.seconds <= 0:
        parser.error(f"--seconds must be positive, not {options.seconds}")
    import common

    try:
        watch_options = common.watch_options(options.option)
    except ValueError as error:
        parser.error(str(error))
    if options.child:
        child(options.child, options.seconds, options.defer, watch_options)
        return
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        parser.error('needs py-spy (pip install -e ".[bench]")')
    mode = "deferred mode (defer=True)" if options.defer else "immediate mode (the CPU default)"
    mode += "".join(f", {key}={value!r}" for key, value in watch_options.items())
    print(f"The default watch's share of a healthy training step, sampled by py-spy {RATE} times a second; "
          f"fp32, CPU, one thread; {mode}")
    print(f"{'model':<10} {'samples':>8} {'share':>7} {'ratio':>7}")
    for name in options.models:
        with tempfile.TemporaryDirectory() as folder:
            raw = os.path.join(folder, "raw.txt")
            command = [sys.executable, __file__, "--child", name, "--seconds", str(options.seconds + 5)]
            if options.defer:
                command.append("--defer")
            command.extend(f"--option={pair}" for pair in options.option)
            process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
            assert process.stdout is not None
            process.stdout.readline()  # settled: sample the steady state only
            record = [spy, "record", "-r", str(RATE), "-f", "raw", "-o", raw, "-d", str(int(options.seconds)),
                      "-p", str(process.pid)]
            sampled = subprocess.run(record, capture_output=True, text=True)
            if sampled.returncode != 0:
                process.kill()
                reason = (sampled.stderr.strip().splitlines() or ["no message"])[-1]
                parser.error(f"py-spy could not sample the training process ({reason}); it needs ptrace "
                             "(root, or CAP_SYS_PTRACE)")
            process.wait()
            with open(raw) as handle:
                steps, ours = share(handle.read(), options.by == "entry")
        part = sum(ours.values()) / max(steps, 1)
        print(f"{name:<10} {steps:>8} {part:>7.1%} {1 / (1 - part):>7.3f}")
        for function, count in ours.most_common(options.top):
            print(f"    {count / steps:6.2%}  {function}")
    print("share: samples in the watch's own code; ratio: 1 / (1 - share)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
