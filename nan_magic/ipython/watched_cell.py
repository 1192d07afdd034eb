"""Running a ``%%nantrace`` body: ``with watch:`` around IPython running it as a cell.

The body is IPython's to run (``shell.run_cell``, as ``%%capture`` does;
``run_cell_async`` where it awaits), never compiled here. IPython shows the
body's exception and returns it in the ExecutionResult; raised again inside
the ``with``, it is how the watch is left, so the watch has one way out and
sees why the cell stopped. The body keeps the line numbers and the cell
number it has in the cell as typed.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from nan_magic.errors.exceptions import NonFiniteError
from nan_magic.errors.frames import cut_where_passed_through
from nan_magic.lifecycle.watch import Watch

__all__ = [
    "as_typed",
    "cut_users_errors",
    "has_code",
    "named_as_the_cell",
    "run_watched",
    "run_watched_async",
    "users_errors_shown_as_theirs",
]


def run_watched(shell: Any, watch: Watch, cell: str) -> tuple[Any, BaseException | None]:
    """``with watch:`` around IPython running ``cell``; its ExecutionResult and the watch's own error.

    IPython shows the cell's exception and returns it in the result; raised
    again inside the ``with``, it is how the watch is left (:func:`_left`).
    """
    __tracebackhide__ = True
    result = None
    try:
        with watch, users_errors_shown_as_theirs(shell):
            result = shell.run_cell(cell)
            _leave_by_the_cells_error(result)
    except BaseException as raised:
        return _left(shell, result, raised)
    return result, None


async def run_watched_async(shell: Any, watch: Watch, cell: str) -> tuple[Any, BaseException | None]:
    """:func:`run_watched` for a body with top-level ``await``, on the event loop already running.

    ``shell.run_cell`` would start a loop of its own, which a kernel's running
    loop refuses; ``run_cell_async`` runs the body on it. The cell events that
    ``run_cell`` fires around it are fired here the same way.
    """
    __tracebackhide__ = True
    result = None
    try:
        with watch, users_errors_shown_as_theirs(shell):
            try:
                result = await shell.run_cell_async(cell, transformed_cell=shell.transform_cell(cell))
            finally:
                shell.events.trigger("post_execute")
                shell.events.trigger("post_run_cell", result)
            _leave_by_the_cells_error(result)
    except BaseException as raised:
        return _left(shell, result, raised)
    return result, None


@contextmanager
def users_errors_shown_as_theirs(shell: Any) -> Iterator[None]:
    """While a watched cell runs: its own errors (not the watch's) shown, and ``%debug`` opened, at the user's line.

    IPython shows a cell's error itself, from its ``showtraceback``, before the watch is left: the user's error
    that passed through the watch's dispatch mode is cut there first (frames.cut_where_passed_through), and an
    interrupt that landed in one of the watch's hooks where it entered the hook.
    """
    undo = cut_users_errors(shell)
    try:
        yield
    finally:
        undo()


def cut_users_errors(shell: Any) -> Callable[[], None]:
    """:func:`users_errors_shown_as_theirs` from now (a ``%nanwatch on`` cell, held between the cell events) until
    the function it returns is called. Shadowed on the shell only where nothing else has shadowed it."""
    if "showtraceback" in vars(shell):
        return lambda: None
    shown = shell.showtraceback

    def showtraceback(exc_tuple: Any = None, *args: Any, **kwargs: Any) -> Any:
        error = exc_tuple[1] if exc_tuple is not None else sys.exc_info()[1]
        if isinstance(error, KeyboardInterrupt):  # (where it landed in a hook is no frame of the user's)
            cut_where_passed_through(error.__traceback__, interrupted=True)
        elif isinstance(error, Exception) and not isinstance(error, NonFiniteError):
            cut_where_passed_through(error.__traceback__)
        return shown(exc_tuple, *args, **kwargs)

    def undo() -> None:
        if vars(shell).get("showtraceback") is showtraceback:
            del shell.showtraceback

    shell.showtraceback = showtraceback
    return undo


def _leave_by_the_cells_error(result: Any) -> None:
    __tracebackhide__ = True
    if result.error_in_exec is not None:
        raise result.error_in_exec


def _left(shell: Any, result: Any, raised: BaseException) -> tuple[Any, BaseException | None]:
    """How a watched body ended, once its watch is left by ``raised``.

    The cell's own exception has been shown by IPython: give it back its
    traceback as shown (raising it again put our frames on it; ``%tb`` and
    ``%debug`` read it). What the watch raised itself as it was left (the
    deferred mode's final check, a non-finite value that explains the cell's
    error) is shown here, as IPython shows any error, so that the report
    displayed next opens under it.
    """
    error = None if result is None else result.error_in_exec
    if raised is error:
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        error.with_traceback(tb)
        return result, None
    if not isinstance(raised, Exception) or result is None:
        raise raised  # an interrupt while leaving, or a failure of IPython itself: not ours to show
    shell.showtraceback((type(raised), raised, raised.__traceback__))
    return result, raised


@contextmanager
def named_as_the_cell(shell: Any, counted: bool) -> Iterator[None]:
    """Name the body ``Cell In[N]`` after the cell ``In[N]`` that runs it, where IPython would say N+1.

    IPython 9 counts a cell from its start (``execution_count`` is N+1
    while cell N runs; its displays subtract one), and names a cell run
    inside it after the count: the body's tracebacks would read
    ``Cell In[N+1]``. The count is lowered while IPython names the body and
    put back by an AST transformer (IPython's public ``ast_transformers``),
    which runs after the naming and before the body runs and displays.
    IPython 7 and 8 count a cell at its end: nothing to do there.
    """
    if not counted or shell.displayhook.prompt_count != shell.execution_count - 1:
        yield
        return
    count = _CountBack(shell)
    shell.execution_count -= 1
    shell.ast_transformers.append(count)
    try:
        yield
    finally:
        shell.ast_transformers.remove(count)
        count.restore()  # a body that never reached its AST (a syntax error)


class _CountBack(ast.NodeTransformer):
    """Puts the cell's count back as the body's AST is transformed (see :func:`named_as_the_cell`)."""

    def __init__(self, shell: Any) -> None:
        super().__init__()
        self.shell = shell
        self.done = False

    def visit(self, node: ast.AST) -> ast.AST:
        self.restore()
        return node

    def restore(self) -> None:
        if not self.done:
            self.done = True
            self.shell.execution_count += 1


def as_typed(line: str, cell: str) -> str:
    """The body as IPython will run it, its lines numbered as in the cell as typed.

    The magic line becomes a comment: ``Cell In[5], line 14`` in a traceback
    is the line the user sees in the cell. A body that starts with another
    cell magic keeps its first line (IPython runs a cell magic only there).
    """
    if cell.lstrip().startswith("%%"):
        return cell
    return f"# %%nantrace {line}".rstrip() + "\n" + cell


def has_code(shell: Any, cell: str) -> bool:
    """Whether ``cell`` holds a statement to watch: blank lines and comments alone ran nothing, and said nothing."""
    if not cell.strip():
        return False
    try:
        return bool(ast.parse(shell.transform_cell(cell)).body)
    except Exception:  # a syntax error: the cell's own run shows it, as IPython's
        return True
