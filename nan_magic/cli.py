"""``python -m nan_magic run script.py [args]``: the watch outside notebooks, and a CI gate.

``python -m nan_magic show nan_scene_step5.pt`` prints the report a scene holds (its
producer, cause and the fixes tried on the failing step) without the code that made it.

The script runs as ``__main__`` (``runpy``, with ``sys.argv`` and
``sys.path[0]`` as ``python script.py`` would set them) under a watch with
no targets: every module the script calls at top level is watched, and each
optimizer and GradScaler the script creates is adopted as a target (the
magics find them in the namespace instead), so that steps a GradScaler
skips stay benign and the dump holds their state.

Exit status:

- 0: the script finished and no real (non-benign) event occurred;
- 1: a real event occurred (whether it stopped the script or, with
  ``--warn``/``--log``, not); the text report is on stderr;
- 2: usage error (bad options, no such script);
- 3: the script raised an exception and no real event occurred (traceback on stderr);
- 130: the run was interrupted (Ctrl-C) and no real event occurred before it;
- the script's own status when it calls ``sys.exit(n)`` and no real event occurred
  (``sys.exit("message")`` prints the message and gives 1, as Python does).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import runpy
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from nan_magic.distributed.ranks import launched_rank, leave_together, per_rank_path, user_type
from nan_magic.errors.exceptions import NonFiniteError, peer_message
from nan_magic.errors.warning_lines import cell_named
from nan_magic.lifecycle.watch import Watch
from nan_magic.options import WATCH_OPTIONS, WatchConfig, config_from_args
from nan_magic.patches.registry import ProcessPatch, Wrap
from nan_magic.records import Report
from nan_magic.scene.load import load_scene
from nan_magic.version import __version__

__all__ = ["main"]

EXIT_CLEAN, EXIT_EVENT, EXIT_USAGE, EXIT_SCRIPT_ERROR = 0, 1, 2, 3
#: Stopped by Ctrl-C with no real event: 128 + SIGINT, the status a shell gives a script it interrupted.
EXIT_INTERRUPTED = 130

#: Our warnings that no line of the script is the place of (a misspelled --types, judged as the run ends) printed
#: without Python's ``nan_magic:0:`` in front of them, as the magics print them (errors/warning_lines.py).
_PLACED_WARNINGS = ProcessPatch.of(warnings, "formatwarning", cell_named)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nan_magic",
        description="Find where a NaN or Inf was born, outside notebooks.",
    )
    # (A CI log records the version it ran; a bare ``--version`` was refused: "the following arguments are required".)
    parser.add_argument("--version", action="version", version=f"nan_magic {__version__} (torch {torch.__version__})")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="run a script under the watch (exit 1 on a real non-finite event)",
        description="Run a Python script under the NaN/Inf watch. Exit status: 0 clean, 1 a real non-finite "
        "event, 2 usage error, 3 the script raised; a script's own sys.exit(n) gives n.",
    )
    for flags, spec in WATCH_OPTIONS:
        run.add_argument(*flags, **spec)
    run.add_argument("--html", default=None, metavar="PATH",
                     help="write the HTML report here (default with --dump: DIR/nan_report.html)")
    run.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON here")
    run.add_argument("script", help="the Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    show = commands.add_parser(
        "show",
        help="print the report a crash scene holds (producer, cause, fixes tried)",
        description="Print the text report of a scene written by a watch with --dump: the producer, the cause "
        "and the fixes tried on a replay of the failing step. Opens the file with torch.load(weights_only=True).",
    )
    show.add_argument("scene", help="a nan_scene_step{N}.pt file")
    show.add_argument("--html", default=None, metavar="PATH", help="also write the HTML report here")
    show.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command and return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "show":
        return _show(args, parser)
    try:
        config = config_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    if not os.path.isfile(args.script):
        parser.error(f"no such script: {args.script}")
    return _run(args, config)


def _show(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print a scene's report on stdout (and write --html/--json); a file that is no scene is a usage error."""
    if not os.path.isfile(args.scene):
        parser.error(f"no such scene file: {args.scene}")
    try:
        scene = load_scene(args.scene, map_location="cpu")
    except ValueError as error:
        parser.error(str(error))
    _say(scene.report.to_text(), sys.stdout)
    args.dump = None
    _write_outputs(scene.report, args)
    return EXIT_CLEAN


def _script_name(target: Any) -> str | None:
    """The name a model the script calls joins the watch under: its variable's in the script's globals (as a
    notebook's joins under its name in the user namespace: ``UncertaintyWeights (root) in weigh``), else its class's.
    None for anything else: an optimizer joins by the watch's own rule (it steps a watched model's parameters)."""
    if not isinstance(target, torch.nn.Module):
        return None
    script = sys.modules.get("__main__")
    names = [name for name, value in list(vars(script).items()) if value is target and not name.startswith("_")]
    return names[0] if names else user_type(target)


def _run(args: argparse.Namespace, config: WatchConfig) -> int:
    watch = Watch(config=config, name_new_target=_script_name)
    script = os.path.abspath(args.script)
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.path.dirname(script))
    status = EXIT_CLEAN
    try:
        with _PLACED_WARNINGS.held(), _adopting(watch), watch:
            runpy.run_path(script, run_name="__main__")
    except NonFiniteError as error:
        error.drop_report_note()  # (the whole report follows the traceback)
        _print_traceback(error, script)
    except SystemExit as exit_:
        status = _exit_status(exit_.code)
    except Exception as error:  # the script's own failure: show it, as Python would
        _print_traceback(error, script)
        status = EXIT_SCRIPT_ERROR
    except KeyboardInterrupt as error:
        # Ctrl-C on a long --warn/--log run: what the watch found before it is still the run's outcome (the
        # report, --json/--html, status 1); before, the interrupt left through here with none of them.
        _print_traceback(error, script, hide_ours=True)
        status = EXIT_INTERRUPTED
    finally:
        sys.stdout.flush()
    report = watch.report
    if report is None:
        print(f"nan_magic: no real non-finite event ({len(watch.events)} benign) in {watch.steps_taken} step(s)",
              file=sys.stderr)
        return status
    if report.rank is None:
        _say(report.to_text(), sys.stderr)
    else:
        _print_ranks_summary(report)
    _write_outputs(report, args)
    # torchrun stops the other ranks as soon as one exits: they first finish their outputs.
    leave_together()
    return EXIT_EVENT


def _print_ranks_summary(report: Report) -> None:
    """Under ``torchrun``: rank 0 shows the report, with one line for the whole job; the others one line each.

    Every rank that stopped at the agreement holds the report of the rank
    that found the event (agreement.py), so rank 0's copy names it.
    """
    here = launched_rank()
    if here == 0:
        _say(report.to_text(), sys.stderr)
        print(f"nan_magic: {report.world_size} ranks: {peer_message(report)}", file=sys.stderr)
    else:
        print(f"nan_magic: rank {here} stopped: {peer_message(report)}", file=sys.stderr)


#: The text report's characters outside ASCII, as a stream that cannot write them (a CI runner's ASCII locale,
#: ``PYTHONIOENCODING=ascii``, a Windows console's code page) reads them best.
_PLAIN = str.maketrans({
    "\u00b7": "*", "\u00b1": "+/-", "\u2213": "-/+", "\u1d40": "^T", "\u00b2": "^2", "\u03bb": "lambda",
    "\u03c3": "sigma", "\u2192": "->", "\u2016": "||", "\u2026": "...", "\u00b5": "u", "\u00e9": "e",
    "\u2581": ".", "\u2582": ".", "\u2583": ":", "\u2584": ":", "\u2585": "+", "\u2586": "+", "\u2587": "#",
    "\u2588": "#",
})


def _say(text: str, stream: Any) -> None:
    """Print ``text`` on ``stream``, in its encoding's characters.

    stdout's errors are strict (``show`` died of a UnicodeEncodeError in our own frames, exit 1 as for an event),
    stderr's escape (``run``'s histograms became ``\\u2581`` runs): where the stream cannot write the report, its
    symbols and bars are written in ASCII, and anything else as ``?``.
    """
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        text = text.translate(_PLAIN).encode(encoding, "replace").decode(encoding)
    except LookupError:
        pass
    print(text, file=stream)


def _print_traceback(error: BaseException, script: str, *, hide_ours: bool = False) -> None:
    """The traceback as ``python script.py`` would show it: from the script's frame on, not ours or runpy's.

    ``hide_ours``: an interrupt, which may land in a watch's hook, is shown without the hook's frames (IPython
    hides them in a notebook likewise); the script's, torch's and the line it stopped at stay.
    """
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    if not hide_ours:
        traceback.print_exception(type(error), error, tb or error.__traceback__, file=sys.stderr)
        return
    ours = os.path.dirname(os.path.abspath(__file__)) + os.sep
    entries = [entry for entry in traceback.extract_tb(tb) if not entry.filename.startswith(ours)]
    shown = traceback.StackSummary.from_list(entries).format()
    print("Traceback (most recent call last):", file=sys.stderr)
    print(*shown, sep="", end="", file=sys.stderr)
    print(*traceback.format_exception_only(type(error), error), sep="", end="", file=sys.stderr)


def _exit_status(code: Any) -> int:
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _write_outputs(report: Report, args: argparse.Namespace) -> None:
    """The HTML and JSON reports; a failure to write them is shown, not raised (the exit status stays 1)."""
    html = args.html or (os.path.join(args.dump, "nan_report.html") if args.dump else None)
    # Under torchrun every rank writes: each to its own file (report.rank1.json).
    html, json_path = (per_rank_path(path) if path else None for path in (html, args.json))
    outputs = [(html, lambda path: report.to_html(path)),
               (json_path, lambda path: pathlib.Path(path).write_text(report.to_json(indent=2), encoding="utf-8"))]
    for path, write in outputs:
        if path is None:
            continue
        try:
            # (--json out/report.json in a fresh CI workspace: its folder made, as --dump makes its own.)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            write(path)
        except Exception as error:  # a missing renderer or a full disk must not hide the event
            print(f"nan_magic: could not write {path}: {type(error).__name__}: {error}", file=sys.stderr)
        else:
            print(f"nan_magic: wrote {path}", file=sys.stderr)


@contextlib.contextmanager
def _adopting(watch: Watch) -> Iterator[None]:
    """Make each optimizer and GradScaler the script creates a target of the watch.

    The magics find them in the namespace before the cell runs; a script
    creates them as it goes, so their constructors are wrapped while it
    runs. Adopting at construction, not at the first ``step()``, matters: a
    GradScaler commonly skips the very first steps, and a step that never
    reaches ``optimizer.step()`` must still count as a training step.
    """
    targets = watch.targets

    def adopting(found: list[Any]) -> Wrap:
        def wrap(init: Any) -> Any:
            def adopt(self: Any, *args: Any, **kwargs: Any) -> None:
                init(self, *args, **kwargs)
                if not any(self is known for known in found):
                    found.append(self)

            return adopt

        return wrap

    patch = ProcessPatch(lambda: [
        (torch.optim.Optimizer, "__init__", adopting(targets.optimizers)),
        (torch.amp.GradScaler, "__init__", adopting(targets.scalers)),
    ])
    with patch.held():
        yield
