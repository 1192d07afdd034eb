"""IPython front end: ``%%nantrace`` and ``%nanwatch``.

Thin by design: parse (IPython's ``magic_arguments``, so ``%%nantrace?`` and
``%nanwatch?`` are the help and bad input is a ``UsageError``), build a
:class:`Watch`, arm it, store and display the report.

The cell is IPython's: an input transformer (IPython's public
``input_transformers_cleanup``) rewrites a ``%%nantrace ARGS`` cell into the
same cell with its first line replaced by a call that arms the watch; the
rest is the user's cell, which IPython transforms, compiles and runs as any
other, so line magics, ``!`` commands, top-level ``await``, the display of
the last value, ``In``/``Out``/``_`` and ``Cell In[5], line 14`` in
tracebacks (with the user's own line numbers) all behave as without the
magic. The watch is disarmed by the ``post_execute`` event, which IPython
triggers after every cell, ``ipython script.ipy``'s silent ones included.

The user's ``set_custom_exc`` handlers are left alone: the short error comes
from ``NonFiniteError._render_traceback_``, which IPython honours. The report
is displayed from ``post_execute``, so it opens *under* the short error.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from torch import nn

from nan_magic.errors.exceptions import NonFiniteError
from nan_magic.hot.targets import _is_grad_scaler
from nan_magic.lifecycle.watch import Watch
from nan_magic.options import WATCH_OPTIONS, config_from_args
from nan_magic.records import Report

__all__ = ["NanMagics", "load", "unload"]

_REPORT_NAME = "_nan_report"
# One NanMagics per loaded shell, so that %unload_ext finds what %load_ext made.
_loaded: dict[int, NanMagics] = {}


def _watch_options(func: Any) -> Any:
    """The options %%nantrace and %nanwatch share (see nan_magic.options)."""
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
    return magic_arguments()(func)


@magics_class
class NanMagics(Magics):
    """The magics; one instance per shell, holding what is armed."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self._cell_watch: Watch | None = None
        self._persistent: tuple[str, Any] | None = None
        self._pending: Report | None = None
        self._last: Watch | None = None
        self._cell_args: Any = None
        self._cell_from_persistent = False

    @property
    def _shell(self) -> Any:
        """The shell (IPython types it as optional; a loaded extension always has one)."""
        assert self.shell is not None
        return self.shell

    # -- magics -------------------------------------------------------------------

    @_watch_options
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
        args = self._parse(self.nantrace, line, "%%nantrace")
        if cell is not None and not cell.strip():
            raise UsageError("%%nantrace: the cell is empty; put the code to watch below the magic line")
        self._arm_for_cell(self._make_watch(args, "%%nantrace"), args, "%%nantrace")
        if cell is not None:
            # Called directly (run_cell_magic), not from a transformed cell:
            # the shell runs the body; its post_execute disarms the watch.
            self._shell.run_cell(cell)

    @_watch_options
    @line_magic
    def nanwatch(self, line: str) -> None:
        """Arm a NaN/Inf watch: for the rest of this cell, or ``on`` for every cell.

        ``%nanwatch [targets] [options]`` watches the rest of the current cell
        (bare ``%nanwatch``: every model, optimizer and GradScaler it calls);
        ``%nanwatch on [targets] [options]`` every following cell until
        ``%nanwatch off``; ``%nanwatch status`` prints what is armed and the
        last report.

        Example::

            %nanwatch on model --warn
            train_one_epoch()          # any cell from here on is watched
            %nanwatch off
        """
        words = line.split()
        if words[:1] in (["off"], ["status"]):
            if len(words) > 1:
                raise UsageError(f"%nanwatch {words[0]} takes no arguments")
            if words[0] == "status":
                print(self._status())
                return
            self._persistent = None
            print("nan_magic: watch off")
            return
        persistent = words[:1] == ["on"]
        rest = line.split(None, 1)[1] if persistent and len(words) > 1 else ("" if persistent else line)
        args = self._parse(self.nanwatch, rest, "%nanwatch")
        watch = self._make_watch(args, "%nanwatch")
        if persistent:
            self._persistent = (rest, args)
            print(f"nan_magic: watching every cell ({self._describe(watch)}) until %nanwatch off")
            return
        self._arm_for_cell(watch, args, "%nanwatch")

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
        from nan_magic.scene.load import load_scene, replay_summary

        args = self._parse(self.nanreplay, line, "%nanreplay")
        if not args.output.isidentifier():
            raise UsageError(f"%nanreplay: -o needs a Python identifier, not {args.output!r}")
        try:
            scene = load_scene(args.path, map_location=args.map_location)
        except (OSError, ValueError) as error:
            raise UsageError(f"%nanreplay: cannot read {args.path}: {error}") from None
        model = self._replay_model(args.model, scene.report.model)
        try:
            if not args.no_restore:
                scene.restore_into(model, state="event")
            result = scene.replay(model)
        except (ValueError, RuntimeError) as error:
            raise UsageError(f"%nanreplay: {error}") from None
        self._shell.user_ns[args.output] = scene
        print(f"nan_magic: {replay_summary(result, scene.module)}")

    def _replay_model(self, expression: str | None, saved_name: str | None) -> nn.Module:
        namespace = self._shell.user_ns
        if expression is not None:
            try:
                model = eval(expression, namespace)
            except Exception as error:  # any failure is a usage error here
                raise UsageError(f"%nanreplay: cannot evaluate {expression!r}: {error}") from None
        elif isinstance(namespace.get(saved_name or ""), nn.Module):
            model = namespace[saved_name]
        else:
            models = [value for value in _discover(namespace)[1] if isinstance(value, nn.Module)]
            if len(models) != 1:
                raise UsageError("%nanreplay: name the model to rebuild the scene on: %nanreplay PATH MODEL")
            model = models[0]
        if not isinstance(model, nn.Module):
            raise UsageError(f"%nanreplay: {expression} is not an nn.Module")
        return model

    # -- parsing and targets --------------------------------------------------------

    def _parse(self, magic: Any, line: str, name: str) -> Any:
        try:
            return parse_argstring(magic, line)
        except UsageError as error:
            raise UsageError(f"{name}: {error}") from None
        except ValueError as error:  # unbalanced quotes from the splitter
            raise UsageError(f"{name}: {error}") from None

    def _make_watch(self, args: Any, name: str) -> Watch:
        try:
            config = config_from_args(args)
        except ValueError as error:
            raise UsageError(f"{name}: {error}") from None
        if not args.output.isidentifier():
            raise UsageError(f"{name}: -o needs a Python identifier, not {args.output!r}")
        namespace = self._shell.user_ns
        if args.targets:
            labels, targets = self._targets(args.targets, name)
        else:
            # Models are found when the cell calls them (it may build them);
            # the namespace's GradScalers are passed so their skipped steps
            # are known as benign, and its models only decide where to check.
            labels, targets = _namespace_scalers(namespace)
            if config.defer is None:
                config = dataclasses.replace(config, defer=_models_on_a_device(namespace))
        try:
            return Watch(targets, labels=labels, config=config, name_new_target=_target_namer(namespace, args.targets))
        except (TypeError, ValueError) as error:
            raise UsageError(f"{name}: {error}") from None

    def _targets(self, expressions: list[str], name: str) -> tuple[list[str], list[Any]]:
        namespace = self._shell.user_ns
        values = []
        for expression in expressions:
            try:
                values.append(eval(expression, namespace))
            except Exception as error:
                raise UsageError(f"{name}: cannot evaluate target {expression!r}: {error}") from None
        return list(expressions), values

    # -- cell-scoped arming ------------------------------------------------------

    def _arm_for_cell(self, watch: Watch, args: Any, name: str) -> None:
        if self._cell_watch is not None:
            if not self._cell_from_persistent:
                raise UsageError(f"{name}: a watch is already armed for this cell")
            # The cell's own magic takes over from the "%nanwatch on" one.
            self._disarm_cell()
        watch.__enter__()
        self._cell_watch = watch
        self._cell_args = args
        self._cell_from_persistent = name == "%nanwatch on"

    def _disarm_cell(self) -> None:
        watch = self._cell_watch
        if watch is None:
            return
        self._cell_watch = None
        try:
            watch.__exit__(None, None, None)
        except NonFiniteError as error:
            # Deferred mode found it at the final check: report it all the same.
            print(f"NonFiniteError: {error}", file=sys.stderr)
        finally:
            if watch.raised is not None:
                # IPython caught and showed it; now cut our frames off its
                # traceback (if showing did not already) and note its frames.
                watch.adopt_traceback(watch.raised, watch.raised.__traceback__)
            self._finish(watch, self._cell_args)

    # -- events ------------------------------------------------------------------

    def pre_execute(self) -> None:
        if self._persistent is not None and self._cell_watch is None:
            _line, args = self._persistent
            try:
                watch = self._make_watch(args, "%nanwatch on")
            except UsageError as error:
                self._persistent = None
                print(f"nan_magic: watch off ({error})", file=sys.stderr)
                return
            self._arm_for_cell(watch, args, "%nanwatch on")

    def post_execute(self) -> None:
        self._disarm_cell()
        if self._pending is not None:
            report, self._pending = self._pending, None
            from IPython.display import display

            display(report)

    def _finish(self, watch: Watch, args: Any) -> None:
        """Store the report in the user namespace and queue its display."""
        self._last = watch
        if watch.report is None and not watch.events:
            return
        report = watch.report or watch.events[-1]
        self._shell.user_ns[args.output] = report
        if not args.quiet:
            self._pending = report

    def disarm_all(self) -> None:
        self._persistent = None
        self._disarm_cell()

    # -- status -------------------------------------------------------------------

    def _describe(self, watch: Watch) -> str:
        names = [label or type(module).__name__ for label, module in watch.targets.roots]
        parts = [", ".join(names) if names else "every module called"]
        if watch.targets.optimizers:
            parts.append(f"{len(watch.targets.optimizers)} optimizer(s)")
        return "; ".join(parts)

    def _status(self) -> str:
        lines = []
        if self._persistent is not None:
            lines.append(f"nan_magic: on for every cell ({self._persistent[0] or 'all targets'})")
        elif self._cell_watch is not None:
            lines.append("nan_magic: armed for this cell")
        else:
            lines.append("nan_magic: off")
        if self._last is not None and self._last.report is not None:
            lines.append(f"last report: {self._last.report.message}")
        return "\n".join(lines)


def _discover(namespace: dict[str, Any]) -> tuple[list[str], list[Any]]:
    """Every top-level module, optimizer and GradScaler in the user namespace.

    A module contained in another discovered module is left to its container
    (watched once, under the container's names).
    """
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for name, value in list(namespace.items()):
        if name.startswith("_") or id(value) in seen:
            continue
        if isinstance(value, (nn.Module,)) or _is_optimizer(value) or _is_grad_scaler(value):
            found.append((name, value))
            seen.add(id(value))
    contained: set[int] = set()
    for _name, value in found:
        if isinstance(value, nn.Module):
            contained |= {id(sub) for sub in value.modules() if sub is not value}
    kept = [(name, value) for name, value in found if id(value) not in contained]
    return [name for name, _ in kept], [value for _, value in kept]


def _is_optimizer(value: Any) -> bool:
    import torch

    return isinstance(value, torch.optim.Optimizer)


def _namespace_scalers(namespace: dict[str, Any]) -> tuple[list[str], list[Any]]:
    """The GradScalers in the user namespace, each once, with their names (as :func:`_discover` finds them)."""
    scalers = [(name, value) for name, value in zip(*_discover(namespace)) if _is_grad_scaler(value)]
    return [name for name, _ in scalers], [value for _, value in scalers]


def _models_on_a_device(namespace: dict[str, Any]) -> bool:
    """Whether a model in the namespace lives off the CPU (the watch then defers its checks)."""
    for value in list(namespace.values()):
        if isinstance(value, nn.Module):
            parameter = next(value.parameters(), None)
            if parameter is not None and parameter.device.type != "cpu":
                return True
    return False


def _target_namer(namespace: dict[str, Any], expressions: list[str]) -> Callable[[Any], str | None]:
    """How a model first called at top level, or an optimizer first stepping, joins the watch.

    Without targets, every model joins, under its name in the namespace (or
    its class name); every optimizer is watched anyway. With targets, one
    joins when a target expression, looked up again now, is that object: a
    cell that rebuilds ``model, opt`` is watched on the new ones, and
    nothing else is.
    """

    def name_new_target(target: Any) -> str | None:
        if not expressions:
            names = (name for name, value in list(namespace.items()) if value is target and not name.startswith("_"))
            return next(names, type(target).__name__)
        for expression in expressions:
            try:
                if eval(expression, namespace) is target:
                    return expression
            except Exception:  # a name the cell has deleted, say: not this object
                continue
        return None

    return name_new_target


_NANTRACE_LINE = re.compile(r"%%nantrace(?=\s|$)")


def _arm_nantrace_cell(lines: list[str]) -> list[str]:
    """Input transformer: ``%%nantrace ARGS`` + body -> a call that arms the watch + body.

    The body stays the user's cell, line for line (the call takes the magic
    line's place), for IPython to transform and run. A ``%%nantrace?`` line
    (help) and an empty body are left to IPython and the magic.
    """
    if not lines or not _NANTRACE_LINE.match(lines[0]) or not "".join(lines[1:]).strip():
        return lines
    magic_line = lines[0][len("%%nantrace"):].strip()
    return [f"get_ipython().run_cell_magic('nantrace', {magic_line!r}, None)\n", *lines[1:]]


# IPython's check_complete (is a terminal cell finished?) skips transformers
# marked like this, so a %%nantrace cell still ends at a blank line there.
_arm_nantrace_cell.has_side_effects = True  # type: ignore[attr-defined]


def load(shell: Any) -> None:
    """Register the magics, the transformer and the cell events (``%load_ext nan_magic``)."""
    magics = NanMagics(shell)
    shell.register_magics(magics)
    shell.input_transformers_cleanup.append(_arm_nantrace_cell)
    shell.events.register("pre_execute", magics.pre_execute)
    shell.events.register("post_execute", magics.post_execute)
    _loaded[id(shell)] = magics


def unload(shell: Any) -> None:
    """Disarm, unregister events and remove the magics (``%unload_ext nan_magic``)."""
    magics = _loaded.pop(id(shell), None)
    if magics is None:
        return
    magics.disarm_all()
    if _arm_nantrace_cell in shell.input_transformers_cleanup:
        shell.input_transformers_cleanup.remove(_arm_nantrace_cell)
    shell.events.unregister("pre_execute", magics.pre_execute)
    shell.events.unregister("post_execute", magics.post_execute)
    shell.magics_manager.magics["cell"].pop("nantrace", None)
    shell.magics_manager.magics["line"].pop("nanwatch", None)
    shell.magics_manager.magics["line"].pop("nanreplay", None)
