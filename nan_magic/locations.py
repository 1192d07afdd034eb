"""Name a source location the way the user knows it.

Code typed into a notebook or IPython cell lives in a temporary file named
after a hash (``/tmp/ipykernel_4242/1234.py``); IPython 8 and later write it
as ``Cell In[5], line 14``, and so do we. IPython 7 (Colab's) names cells
``<ipython-input-5-88efa2196d22>`` and cannot say more; we name those
``Cell In[5]`` too. Any other file is named relative to the working
directory, where the user's own modules usually are.

Stdlib only, and IPython is never imported here: where IPython already
runs, it is found in ``sys.modules``.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["SourcePointer", "cell_location", "cells_named", "function_name", "name_location", "running_shell"]


def running_shell() -> Any:
    """The running IPython shell, or None (without importing IPython)."""
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    return get_ipython() if get_ipython is not None else None


#: The pseudo file name IPython 7 compiles cell N into (``<ipython-input-5-88efa2196d22>``).
_IPYTHON7_CELL = re.compile(r"<ipython-input-(\d+)-[0-9a-f]+>")


def _cell_name(filename: str) -> str | None:
    """``Cell In[5]`` for a file IPython compiled from a cell, else None."""
    shell = running_shell()
    # IPython 8+ knows its cells' files (CachingCompiler.format_code_name);
    # IPython 7 has no such method, but its file names carry the number.
    format_code_name = getattr(getattr(shell, "compile", None), "format_code_name", None)
    named = format_code_name(filename) if format_code_name is not None else None
    if named:
        return f"{named[0]} {named[1]}"
    match = _IPYTHON7_CELL.fullmatch(filename)
    return f"Cell In[{match.group(1)}]" if match else None


def _path_name(filename: str) -> str:
    """The path relative to the working directory; one outside it stays absolute (``..`` chains help no
    one), and ``<string>``-like pseudo files are returned as they are."""
    if filename.startswith("<") or not os.path.isabs(filename):
        return filename
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive (Windows): no relative path exists
        return filename
    return filename if relative.startswith(os.pardir) else relative


def name_location(filename: str, lineno: int) -> str:
    """``Cell In[5], line 14`` for a cell, ``models/net.py:14`` for a file."""
    cell = _cell_name(filename)  # a cell is named by its own words
    return f"{cell}, line {lineno}" if cell is not None else f"{_path_name(filename)}:{lineno}"


def cell_location(filename: str, lineno: int) -> str | None:
    """``Cell In[5], line 14`` where ``filename`` is a file IPython compiled a cell into, else None."""
    cell = _cell_name(filename)
    return f"{cell}, line {lineno}" if cell is not None else None


def cells_named(value: Any) -> Any:
    """Plain data (dicts, tuples, lists, strings), each file that IPython compiled a cell into renamed as IPython 7
    names a cell.

    ``/tmp/ipykernel_42/1234.py`` is ``Cell In[5]`` only to the kernel that ran the cell: read after a restart
    (a scene, a pickled or ``%store``-d report, its JSON), or by ``python -m nan_magic show``, it would name a temporary
    file that is gone. As ``<ipython-input-5-1234>`` it is still shown as ``Cell In[5], line 14``.
    """
    if isinstance(value, dict):
        return {key: cells_named(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(cells_named(item) for item in value)
    if not isinstance(value, str):
        return value
    format_code_name = getattr(getattr(running_shell(), "compile", None), "format_code_name", None)
    named = format_code_name(value) if format_code_name is not None else None
    number = re.fullmatch(r"In\[(\d+)\]", named[1]) if named else None
    if number is None:
        return value
    stem = os.path.splitext(os.path.basename(value))[0]
    return f"<ipython-input-{number.group(1)}-{stem if re.fullmatch('[0-9a-f]+', stem) else secrets.token_hex(4)}>"


def function_name(code_name: str) -> str:
    """A code object's name as a :class:`SourcePointer` gives it: a cell's top level is ``<module>``."""
    return "<module>" if code_name.startswith("<cell line:") else code_name


@dataclass(frozen=True, repr=False)
class SourcePointer:
    """A line of source code: where an op ran or a frame stopped."""

    filename: str
    lineno: int
    function: str
    line: str | None = None

    def __post_init__(self) -> None:
        # IPython 7 (Colab's) names a cell's top level "<cell line: N>", N being 0 on Python 3.11 and the
        # statement's first line on 3.12: "Cell In[3], line 6, in <cell line: 0>" read as two lines that
        # disagree. IPython 8+ names it as Python does; one name on every stack (a scene's too, read back).
        if self.function.startswith("<cell line:"):
            object.__setattr__(self, "function", function_name(self.function))

    def __str__(self) -> str:
        return f"{name_location(self.filename, self.lineno)}, in {self.function}"

    def __repr__(self) -> str:
        # A cell's file is the kernel's temporary one (/tmp/ipykernel_42/1234.py), a name the user never saw: the
        # fields stay as they are (they are what reopens it), and the repr also says the cell, as str() does.
        # The cell goes right after the file it names, inside the parentheses: a Report's repr holds this one.
        cell = _cell_name(self.filename)
        named = repr(self.filename) + (f" ({cell})" if cell is not None else "")
        return (f"SourcePointer(filename={named}, lineno={self.lineno!r}, function={self.function!r}, "
                f"line={self.line!r})")
