"""IPython front end: ``%%nantrace``, ``%nanwatch`` and ``%nanreplay``.

Thin by design: parse (IPython's ``magic_arguments``, so ``%%nantrace?`` and
``%nanwatch?`` are the help and bad input is a ``UsageError``), build a
:class:`Watch`, run, store and display the report.

``%%nantrace`` is ``with watch: run the cell``, as IPython's own ``%%capture``:
the shell runs the body (``shell.run_cell``), so line magics, ``!`` commands,
top-level ``await`` and the display of the last value behave as in any cell,
and the cell's exception, which IPython has shown, leaves the watch as the
exception of its ``with`` block: the watch has one way out and sees why the
cell stopped. ``%nanwatch`` (the rest of this cell) and ``%nanwatch on``
(every cell) hold the watch between IPython's public ``pre_run_cell`` and
``post_run_cell`` events; the latter hands over the cell's result, hence its
exception. ``%nanwatch on`` holds one watch for its run, paused between cells
(``Watch.pause`` and ``resume``): a loop whose ``opt.step()`` is in the next
cell counts its iterations, and keeps its history, as one cell would.

The user's ``set_custom_exc`` handlers are left alone: the short error comes
from ``NonFiniteError._render_traceback_``, which IPython honours. The report
is displayed once the watch is left, so it opens *under* the short error.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import warnings
from functools import partial
from typing import Any

from IPython import get_ipython
from IPython.core.error import UsageError
from IPython.core.magic import cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, kwds, magic_arguments, parse_argstring
from torch import nn

from nan_magic.distributed.ranks import launched
from nan_magic.errors.warning_lines import cell_named
from nan_magic.ipython.arguments import MagicHelp, target_names, unquoted_options
from nan_magic.ipython.held_watch import HeldWatchMagics, _Held
from nan_magic.ipython.namespace import discover, models_on_a_device, namespace_scalers, target_namer
from nan_magic.ipython.watched_cell import as_typed, has_code, named_as_the_cell, run_watched, run_watched_async
from nan_magic.lifecycle.watch import Watch
from nan_magic.options import WATCH_OPTIONS, config_from_args
from nan_magic.patches.registry import ProcessPatch

__all__ = ["NanMagics", "load", "unload"]

_REPORT_NAME = "_nan_report"
# One NanMagics per loaded shell, so that %unload_ext finds what %load_ext made.
_loaded: dict[int, NanMagics] = {}
#: The watch's warnings from a cell printed as ``Cell In[5], line 4`` while the extension is loaded
#: (errors/warning_lines.py), taken back at unload unless someone wrapped ``warnings.formatwarning`` after us.
_CELL_NAMED_WARNINGS = ProcessPatch.of(warnings, "formatwarning", cell_named)


def _exact_options(func: Any) -> Any:
    """Options as typed, never abbreviated: argparse took ``--ful`` for ``--full`` (and a later option sharing the
    prefix would silently change what an old notebook's line means); an unknown one is a UsageError naming them
    (:func:`_with_the_options`). Set on the parser IPython built (its constructor takes no ``allow_abbrev``;
    argparse reads the attribute as it parses)."""
    func.parser.allow_abbrev = False
    return func


def _watch_options(func: Any, *, cell: bool = False) -> Any:
    """The options %%nantrace and %nanwatch share (see nan_magic.options).

    ``cell``: the help's usage line names a cell magic with its two ``%`` (IPython writes one before the name it is
    given: ``%%nantrace?`` began ``%nantrace [--warn] ...``, a line magic that does not exist)."""
    decorators = [
        argument("targets", nargs="*", help="names or expressions of models, optimizers, GradScalers "
                 "(default: every one the cell calls, created in it or not)"),
        *(argument(*flags, **spec) for flags, spec in WATCH_OPTIONS),
        argument("-o", "--output", default=_REPORT_NAME, metavar="NAME",
                 help=f"user variable that receives the report (default {_REPORT_NAME})"),
        argument("-q", "--quiet", action="store_true", help="do not display the report"),
    ]
    # magic_arguments lists options in source order, i.e. reverse application.
    for decorator in reversed(decorators):
        func = decorator(func)
    func = kwds(formatter_class=MagicHelp)(func)  # (the help laid out as argparse's: arguments.py)
    return _exact_options(magic_arguments(name=f"%{func.__name__}" if cell else None)(func))


@magics_class
class NanMagics(HeldWatchMagics):
    """The magics; one instance per shell, holding what is armed (between the cell events: held_watch.py)."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        #: ``%nanwatch on``: its line, parsed options and the watch of its run (made at its first cell, made
        #: again after the run raised), paused between cells.
        self._persistent: tuple[str, Any, Watch | None] | None = None
        self._held: _Held | None = None
        #: %%nantrace bodies running now: the run_cell events they fire are not cells of their own.
        self._bodies = 0
        #: What the last %%nantrace body ended with (its result, the watch's own error), for the cell's result.
        self._outcome: tuple[Any, BaseException | None] | None = None
        #: Whether the cell running now is counted in the history (``In[N]``; pre_run_cell says).
        self._cell_counted = False
        #: Whether a cell is running (between its pre_run_cell and post_run_cell), not a magic called directly.
        self._in_cell = False
        #: The report of the last watch that stopped at an event, for ``%nanwatch status``: kept until another
        #: event, not lost to the healthy cells after it (each cell under ``%nanwatch on`` is a watch's run).
        self._last_report: Any = None
        self._unloaded = False

    # -- magics -------------------------------------------------------------------

    @partial(_watch_options, cell=True)
    @cell_magic
    def nantrace(self, line: str, cell: str | None) -> None:
        """Run this cell under a NaN/Inf watch; stop at the first non-finite value.

        The cell runs as any other (magics, ``!`` commands and ``await`` work
        in it). The report (producer module, op and line, per-layer table,
        histograms, likely cause) opens under a short error, is stored as
        ``_nan_report``, and ``%debug`` opens in the frame nearest the
        producer. Without targets, every model, optimizer and GradScaler the
        cell calls is watched, including ones the cell creates; with
        targets, only those (their names are looked up again when a model is
        called or an optimizer steps, so ``model, opt = build()`` inside the
        cell is followed).
        Hooks exist only while the cell runs.

        Example::

            %%nantrace model opt --include 'encoder.*'
            for x, y in loader:
                loss = loss_fn(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
        """
        __tracebackhide__ = True
        watch, args = self._start_nantrace(line, cell)
        self._bodies += 1
        try:
            with named_as_the_cell(self._shell, self._cell_counted):
                self._outcome = run_watched(self._shell, watch, as_typed(line, cell or ""))
        finally:
            self._bodies -= 1
        self._finish(watch, args)

    async def nantrace_async(self, line: str, cell: str) -> None:
        """``%%nantrace`` for a body with top-level ``await``, awaited by the cell (:func:`awaiting_nantrace`)."""
        __tracebackhide__ = True
        watch, args = self._start_nantrace(line, cell)
        self._bodies += 1
        try:
            with named_as_the_cell(self._shell, self._cell_counted):
                self._outcome = await run_watched_async(self._shell, watch, as_typed(line, cell))
        finally:
            self._bodies -= 1
        self._finish(watch, args)

    def _start_nantrace(self, line: str, cell: str | None) -> tuple[Watch, Any]:
        args = self._parse(self.nantrace, line, "%%nantrace")
        if not has_code(self._shell, cell or ""):
            raise UsageError("%%nantrace: the cell is empty; put the code to watch below the magic line")
        watch = self._make_watch(args, "%%nantrace")
        self._take_over("%%nantrace")
        return watch, args

    @_watch_options
    @line_magic
    def nanwatch(self, line: str) -> None:
        """Arm a NaN/Inf watch: for the rest of this cell, or ``on`` for every cell.

        ``%nanwatch [targets] [options]`` watches the rest of the current cell
        (bare ``%nanwatch``: every model, optimizer and GradScaler it calls);
        ``%nanwatch on [targets] [options]`` the rest of the cell and every
        following cell until ``%nanwatch off``; ``%nanwatch status`` prints
        what is armed and the last report.

        Example::

            %nanwatch on model --warn
            train_one_epoch()          # any cell from here on is watched
            %nanwatch off
        """
        self._check_loaded()
        words = line.split()
        if words[:1] in (["off"], ["status"]):
            if len(words) > 1:
                raise UsageError(f"%nanwatch {words[0]} takes no arguments")
            if words[0] == "status":
                print(self._status())
                return
            print(self._turn_off())
            return
        persistent = words[:1] == ["on"]
        if words and words[0].isidentifier() and not persistent and words[0] not in self._shell.user_ns:
            # A mistyped subcommand (%nanwatch of, %nanwatch maybe) would be read as a target: say what is asked.
            raise UsageError(f"%nanwatch: {words[0]!r} is not on, off or status, nor a name defined here "
                             "(the models, optimizers or GradScalers to watch)")
        rest = line.split(None, 1)[1] if persistent and len(words) > 1 else ("" if persistent else line)
        args = self._parse(self.nanwatch, rest, "%nanwatch")
        watch = self._make_watch(args, "%nanwatch")
        if persistent:
            # (On again while on, the setup cell run again, say: a new run, as after off and on, whose steps count
            # from 0; the model it made may be new too. Said, so a step number is not read against the old count.)
            again = "; it was on: a new run, its steps counted from 0" if self._persistent is not None else ""
            self._persistent = (rest, args, None)
            print(f"nan_magic: watching every cell ({self._describe(watch, args.defer)}) until %nanwatch off{again}")
            if self._in_cell and self._held is None:
                # The rest of this cell too, as ``%nanwatch`` watches the rest of its cell: a user who puts
                # ``%nanwatch on model`` above the training loop means that loop (it ran unwatched).
                self._persistent = (rest, args, watch)
                self._hold(watch, args, persistent=True)
            return
        self._take_over("%nanwatch")
        self._hold(watch, args, persistent=False)

    def _turn_off(self) -> str:
        """``%nanwatch off``: leave what ``%nanwatch`` armed; say what is off, or that nothing was on."""
        was_on = self._persistent is not None
        self._persistent = None
        if self._held is not None and self._held.depth == self._bodies:
            # Off is off from this line, whether ``%nanwatch on`` or this cell's ``%nanwatch`` armed it: the rest of
            # the cell runs unwatched, as the status then says.
            self._release(None)
            return "nan_magic: watch off"
        if self._bodies:  # a %%nantrace body: its cell's watch is the magic's own, left at the cell's end
            following = "watch off for the following cells; " if was_on else ""
            return f"nan_magic: {following}this %%nantrace cell stays watched to its end"
        return "nan_magic: watch off" if was_on else "nan_magic: no watch is on (nothing to turn off)"

    @_exact_options
    @magic_arguments()
    @argument("path", help="a scene file saved with --dump")
    @argument("model", nargs="?", default=None,
              help="the model to rebuild the scene on (default: the scene's model name, or the only model)")
    @argument("--no-restore", action="store_true",
              help="replay on the model as it is (do not load the scene's weights into it first)")
    @argument("--map-location", default=None, metavar="DEVICE", help="where to load the scene's tensors (e.g. cpu)")
    @argument("-o", "--output", default="_nan_scene", metavar="NAME",
              help="user variable that receives the Scene (default _nan_scene)")
    @line_magic
    def nanreplay(self, line: str) -> None:
        """Rebuild a crash scene and replay the producer module on its exact inputs.

        Loads the scene into the model (its weights and train/eval modes; a
        fixed version of the model is fine), re-runs the producer module on
        the saved inputs under op-level tracing and prints what it found.
        The Scene is stored as ``_nan_scene`` (``.batch``, ``.rerun_step``).

        Example::

            %nanreplay dumps/nan_scene_step41.pt model
            model.norm.eps = 1e-5
            %nanreplay dumps/nan_scene_step41.pt model   # "... stayed finite"
        """
        from nan_magic.render.words.replay_words import replay_line
        from nan_magic.scene.load import load_scene

        self._check_loaded()
        args = self._parse(self.nanreplay, line, "%nanreplay")
        if not args.output.isidentifier():
            raise UsageError(f"%nanreplay: -o needs a Python identifier, not {args.output!r}")
        try:
            scene = load_scene(args.path, map_location=args.map_location)
        except (OSError, ValueError) as error:
            raise UsageError(f"%nanreplay: cannot read {args.path}: {error}") from None
        # Stored first: what a scene holds needs no model, and where the replay cannot run (no model yet, a producer
        # outside every module) the user goes on from it (its report, rerun_step), as the errors below say.
        self._shell.user_ns[args.output] = scene
        model = self._replay_model(args.model, scene, args.output)
        try:
            if not args.no_restore:
                scene.restore_into(model, state="event")
            result = scene.replay(model)
        except (ValueError, RuntimeError) as error:
            raise UsageError(f"%nanreplay: {error} (the scene is loaded as {args.output})") from None
        print(f"nan_magic: {replay_line(scene.module, result.finding, result.note)}")

    def _replay_model(self, expression: str | None, scene: Any, output: str) -> nn.Module:
        namespace = self._shell.user_ns
        saved_name = scene.report.model
        if expression is not None:
            model = self._eval(expression, "%nanreplay: cannot evaluate")
        elif isinstance(namespace.get(saved_name or ""), nn.Module):
            model = namespace[saved_name]
        else:
            models = [value for value in discover(namespace)[1] if isinstance(value, nn.Module)]
            if not models:
                # After a restart: no model yet. What the scene holds needs none; the replay does.
                name = saved_name or "MODEL"
                raise UsageError(
                    f"%nanreplay: no model here to replay the scene on (it was saved from {name}): build it, then "
                    f"%nanreplay PATH {name}; the scene is loaded as {output}, and {output}.report is its report"
                )
            if len(models) != 1:
                raise UsageError("%nanreplay: name the model to rebuild the scene on: %nanreplay PATH MODEL")
            model = models[0]
        if not isinstance(model, nn.Module):
            raise UsageError(f"%nanreplay: {expression} is not an nn.Module")
        return model

    # -- parsing and targets --------------------------------------------------------

    def _check_loaded(self) -> None:
        if self._unloaded:  # IPython has no public way to remove a magic: an unloaded one says so
            raise UsageError("nan_magic is unloaded; %load_ext nan_magic to use its magics again")

    def _parse(self, magic: Any, line: str, name: str) -> Any:
        self._check_loaded()
        try:
            return unquoted_options(parse_argstring(magic, line))
        except (UsageError, ValueError) as error:  # ValueError: unbalanced quotes from the splitter
            raise UsageError(f"{name}: {_with_the_options(str(error), magic)}") from None

    def _make_watch(self, args: Any, name: str) -> Watch:
        try:
            config = config_from_args(args)
        except ValueError as error:
            raise UsageError(f"{name}: {error}") from None
        if not args.output.isidentifier():
            raise UsageError(f"{name}: -o needs a Python identifier, not {args.output!r}")
        namespace = self._shell.user_ns
        args.targets = target_names(args.targets)  # "model, opt" as two names (arguments.py)
        if args.targets:
            labels = list(args.targets)
            targets = [self._eval(expression, f"{name}: cannot evaluate target") for expression in args.targets]
        else:
            # Models are found when the cell calls them (it may build them);
            # the namespace's GradScalers are passed so their skipped steps
            # are known as benign, and its models only decide where to check.
            labels, targets = namespace_scalers(namespace)
            if config.defer is None and not config.ops:  # (ops: immediate but under a process group, hot/timing.py)
                config = dataclasses.replace(config, defer=models_on_a_device(namespace))
        try:
            return Watch(targets, labels=labels, config=config, name_new_target=target_namer(namespace, args.targets))
        except (TypeError, ValueError) as error:
            raise UsageError(f"{name}: {error}") from None

    def _eval(self, expression: str, failure: str) -> Any:
        try:
            return eval(expression, self._shell.user_ns)
        except Exception as error:  # any failure is a usage error here
            raise UsageError(f"{failure} {expression!r}: {error}") from None

    # -- status -------------------------------------------------------------------

    def _describe(self, watch: Watch, asked: bool | None) -> str:
        """What the watch covers and the options it took; ``asked``: whether the user gave ``--defer`` (else a model
        on a GPU chose the deferred checks, said so: a GPU user's report comes at the step's check)."""
        names = [label or type(module).__name__ for label, module in watch.targets.roots]
        parts = [", ".join(names) if names else "every module called"]
        if watch.targets.optimizers:
            parts.append(f"{len(watch.targets.optimizers)} optimizer(s)")
        config = watch.config  # the options the user gave beyond the default, so that they see them taken
        if config.ops:
            parts.append("every op traced (--ops)")
        elif config.mode == "full":
            parts.append("every module call checked (--full)")
        if watch.defer:  # the watch's own choice (hot/timing.py), not only the option: a GPU model defers unasked
            why = "" if asked else ", as this process is one of a group" if launched() else ", as a model is on a GPU"
            parts.append("deferred: checked once a step" + why)
        return "; ".join(parts)

    def _status(self) -> str:
        lines = []
        if self._persistent is not None:
            lines.append(f"nan_magic: on for every cell ({self._persistent[0] or 'all targets'})")
        elif self._held is not None:
            lines.append("nan_magic: armed for this cell")
        else:
            lines.append("nan_magic: off")
        if self._last_report is not None:
            lines.append(f"last report: {self._last_report.message}")
        return "\n".join(lines)


_NANTRACE_LINE = re.compile(r"%%nantrace(?=\s|$)")


def _await_nantrace_bodies(lines: list[str]) -> list[str]:
    """Input transformer: a ``%%nantrace`` cell whose body awaits becomes a cell that awaits the magic.

    A magic is a plain call: its body would need an event loop of its own,
    which a kernel (its loop already running) refuses. Awaited by the cell,
    the body runs on the kernel's loop (:meth:`NanMagics.nantrace_async`).
    Every other cell, and every other ``%%nantrace`` cell, is left to IPython.
    """
    if not lines or not _NANTRACE_LINE.match(lines[0]):
        return lines
    body = "".join(lines[1:])
    shell = get_ipython()
    try:
        awaits = body.strip() and shell.should_run_async(body, transformed_cell=shell.transform_cell(body))
    except Exception:  # a body IPython cannot transform: the magic's own run reports it
        return lines
    if not awaits:
        return lines
    line = lines[0][len("%%nantrace"):].strip()
    return [f"await __import__('nan_magic.ipython.magics').ipython.magics.awaiting_nantrace({line!r}, {body!r})\n"]


# IPython's check_complete (is a terminal cell finished?) skips transformers
# marked like this, so a %%nantrace cell still ends at a blank line there.
_await_nantrace_bodies.has_side_effects = True  # type: ignore[attr-defined]


async def awaiting_nantrace(line: str, cell: str) -> None:
    """What a ``%%nantrace`` cell whose body awaits runs (:func:`_await_nantrace_bodies`)."""
    __tracebackhide__ = True
    magics = _loaded.get(id(get_ipython()))
    if magics is None:
        raise UsageError("nan_magic is unloaded; %load_ext nan_magic to use its magics again")
    await magics.nantrace_async(line, cell)


def load(shell: Any) -> None:
    """Register the magics, the transformer and the cell events (``%load_ext nan_magic``)."""
    magics = NanMagics(shell)
    shell.register_magics(magics)
    shell.input_transformers_cleanup.append(_await_nantrace_bodies)
    shell.events.register("pre_run_cell", magics.pre_run_cell)
    shell.events.register("post_run_cell", magics.post_run_cell)
    if id(shell) not in _loaded:  # (held once per shell: unload lets go once)
        _CELL_NAMED_WARNINGS.acquire()
    _loaded[id(shell)] = magics


def unload(shell: Any) -> None:
    """Disarm and unregister the events (``%unload_ext nan_magic``).

    IPython has no public way to remove a magic: the magics stay registered
    and answer that nan_magic is unloaded, until ``%load_ext`` replaces them.
    """
    magics = _loaded.pop(id(shell), None)
    if magics is None:
        return
    magics.unload()
    _CELL_NAMED_WARNINGS.release()
    if _await_nantrace_bodies in shell.input_transformers_cleanup:
        shell.input_transformers_cleanup.remove(_await_nantrace_bodies)
    shell.events.unregister("pre_run_cell", magics.pre_run_cell)
    shell.events.unregister("post_run_cell", magics.post_run_cell)


_FLAG_GIVEN_A_VALUE = re.compile(r"argument (--?[\w-]+(?:/--?[\w-]+)?): ignored explicit argument '(.*)'")


def _with_the_options(message: str, magic: Any) -> str:
    """argparse's "unrecognized arguments: --ful", with the nearest option and the list of them (one line).

    argparse's "argument --ops: ignored explicit argument 'yes'" (a flag given a value, ``--ops=yes``) says that the
    flag takes no value, and how to write it.
    """
    flag = _FLAG_GIVEN_A_VALUE.fullmatch(message)
    if flag:
        name, value = flag.group(1).split("/")[-1], flag.group(2)
        return f"{name} takes no value: write {name} alone, not {name}={value}"
    if not message.startswith("unrecognized arguments:"):
        return message
    options = sorted(option for option in magic.parser._option_string_actions if option.startswith("--"))
    unknown = [word for word in message.split(":", 1)[1].split() if word.startswith("-")]
    given = unknown[0].split("=", 1)[0] if unknown else None
    near = difflib.get_close_matches(given, options, n=1, cutoff=0.75) if given else []
    if given == "--mode":
        # watch()'s keyword written as an option (--mode full): the magics' flag for mode="full" is --full.
        guess = " (did you mean --full? watch()'s mode=\"full\" is --full here)"
    else:
        guess = f" (did you mean {near[0]}?)" if near else ""
    return f"{message}{guess}; the options are {', '.join(options)}"
