"""IPython front end: ``%%nantrace`` and ``%nanwatch``.

Thin by design: parse (IPython's ``magic_arguments``, so ``%nantrace?`` is the
help and bad input is a ``UsageError``), build a :class:`WatchConfig`, run the
engine, store and display the report. Only public IPython APIs are used:
``register_magics``, ``events.register``/``unregister``, ``set_custom_exc``.

Where the report appears: IPython prints the cell's traceback when the cell
ends; the report is displayed from the ``post_run_cell`` event, so it opens
*under* the short error line.
"""

from __future__ import annotations

import ast
import sys
from types import TracebackType
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from torch import nn

from nan_magic.engine.errors import NonFiniteError
from nan_magic.engine.targets import _is_grad_scaler
from nan_magic.engine.watch import Watch
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
                 "(default: every one in the namespace)"),
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

    @property
    def _shell(self) -> Any:
        """The shell (IPython types it as optional; a loaded extension always has one)."""
        assert self.shell is not None
        return self.shell

    # -- magics -------------------------------------------------------------------

    @_watch_options
    @cell_magic
    def nantrace(self, line: str, cell: str) -> Any:
        """Run this cell under a NaN/Inf watch; stop at the first non-finite value.

        The report (producer module, op and line, per-layer table, histograms,
        likely cause) opens under the error, is stored as ``_nan_report`` and
        ``%debug`` opens in the frame that produced the value. Hooks exist only
        while the cell runs.

        Example::

            %%nantrace model opt --include 'encoder.*'
            for x, y in loader:
                loss = loss_fn(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
        """
        __tracebackhide__ = True
        args = self._parse(self.nantrace, line, "%%nantrace")
        if not cell.strip():
            raise UsageError("%%nantrace: the cell is empty; put the code to watch below the magic line")
        watch = self._make_watch(args, "%%nantrace")
        code, last_expr = self._compile_cell(cell)
        try:
            with watch:
                exec(code, self._shell.user_ns)
                result = eval(last_expr, self._shell.user_ns) if last_expr is not None else None
        finally:
            self._finish(watch, args)
        return result

    @_watch_options
    @line_magic
    def nanwatch(self, line: str) -> None:
        """Arm a NaN/Inf watch: for the rest of this cell, or ``on`` for every cell.

        ``%nanwatch [targets] [options]`` watches the rest of the current cell;
        ``%nanwatch on [targets] [options]`` every following cell until
        ``%nanwatch off``; bare ``%nanwatch`` prints the status.

        Example::

            %nanwatch on model --warn
            train_one_epoch()          # any cell from here on is watched
            %nanwatch off
        """
        words = line.split()
        if not words:
            print(self._status())
            return
        if words[0] == "off":
            if len(words) > 1:
                raise UsageError("%nanwatch off takes no arguments")
            self._persistent = None
            print("nan_magic: watch off")
            return
        persistent = words[0] == "on"
        rest = line.split(None, 1)[1] if persistent and len(words) > 1 else ("" if persistent else line)
        args = self._parse(self.nanwatch, rest, "%nanwatch")
        watch = self._make_watch(args, "%nanwatch")
        if persistent:
            self._persistent = (rest, args)
            print(f"nan_magic: watching every cell ({self._describe(watch)}) until %nanwatch off")
            return
        self._arm_for_cell(watch, args)

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
        from nan_magic.engine.scene import load_scene, replay_summary

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
        labels, targets = self._targets(args.targets, name)
        try:
            return Watch(targets, labels=labels, config=config)
        except (TypeError, ValueError) as error:
            raise UsageError(f"{name}: {error}") from None

    def _targets(self, expressions: list[str], name: str) -> tuple[list[str], list[Any]]:
        namespace = self._shell.user_ns
        if expressions:
            values = []
            for expression in expressions:
                try:
                    values.append(eval(expression, namespace))
                except Exception as error:
                    raise UsageError(f"{name}: cannot evaluate target {expression!r}: {error}") from None
            return list(expressions), values
        return _discover(namespace)

    def _compile_cell(self, cell: str) -> tuple[Any, Any]:
        """Compile the cell like IPython does (its lines show in tracebacks).

        A final expression is evaluated separately so its value is displayed,
        as it would be without the magic.
        """
        compiler = self._shell.compile
        try:
            tree = compiler.ast_parse(cell)
        except SyntaxError as error:
            raise UsageError(f"%%nantrace: the cell has a syntax error: {error}") from None
        filename = compiler.cache(cell)
        last_expr = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last_expr = compile(ast.Expression(tree.body.pop().value), filename, "eval")
        return compile(tree, filename, "exec"), last_expr

    # -- cell-scoped arming ------------------------------------------------------

    def _arm_for_cell(self, watch: Watch, args: Any) -> None:
        if self._cell_watch is not None:
            raise UsageError("%nanwatch: a watch is already armed for this cell")
        watch.__enter__()
        self._cell_watch = watch
        self._cell_args = args
        # The cell's exception reaches IPython, not us: trim its traceback so
        # the printed lines and %debug end in the user's frame.
        self._shell.set_custom_exc((NonFiniteError,), self._show_nonfinite)

    def _show_nonfinite(
        self, shell: Any, etype: type, value: BaseException, tb: TracebackType, tb_offset: int | None = None
    ) -> Any:
        __tracebackhide__ = True
        watch = self._cell_watch
        if watch is not None and isinstance(value, NonFiniteError):
            watch.adopt_traceback(value, tb)
        return shell.showtraceback((etype, value, tb), tb_offset=tb_offset)

    def _disarm_cell(self) -> None:
        watch = self._cell_watch
        if watch is None:
            return
        self._cell_watch = None
        self._shell.set_custom_exc((), None)
        try:
            watch.__exit__(None, None, None)
        except NonFiniteError as error:
            # Deferred mode found it at the final check: report it all the same.
            print(f"NonFiniteError: {error}", file=sys.stderr)
        finally:
            self._finish(watch, self._cell_args)

    # -- events ------------------------------------------------------------------

    def pre_run_cell(self, info: Any = None) -> None:
        if self._persistent is not None and self._cell_watch is None:
            _line, args = self._persistent
            try:
                watch = self._make_watch(args, "%nanwatch on")
            except UsageError as error:
                self._persistent = None
                print(f"nan_magic: watch off ({error})", file=sys.stderr)
                return
            self._arm_for_cell(watch, args)

    def post_run_cell(self, result: Any = None) -> None:
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


def load(shell: Any) -> None:
    """Register the magics and the cell events (``%load_ext nan_magic``)."""
    magics = NanMagics(shell)
    shell.register_magics(magics)
    shell.events.register("pre_run_cell", magics.pre_run_cell)
    shell.events.register("post_run_cell", magics.post_run_cell)
    _loaded[id(shell)] = magics


def unload(shell: Any) -> None:
    """Disarm, unregister events and remove the magics (``%unload_ext nan_magic``)."""
    magics = _loaded.pop(id(shell), None)
    if magics is None:
        return
    magics.disarm_all()
    shell.events.unregister("pre_run_cell", magics.pre_run_cell)
    shell.events.unregister("post_run_cell", magics.post_run_cell)
    shell.magics_manager.magics["cell"].pop("nantrace", None)
    shell.magics_manager.magics["line"].pop("nanwatch", None)
    shell.magics_manager.magics["line"].pop("nanreplay", None)
