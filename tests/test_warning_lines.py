"""The watch's warnings from a cell name it as the report and IPython's tracebacks do: ``Cell In[N], line M``.

Python prints a warning as ``filename:line: Category: message``; in a notebook the filename is the kernel's
temporary file for the cell (``/tmp/ipykernel_42/1234.py``), a name the user never typed (round 21). Only the
printed text changes: the category and the filename the filters and the registry see stay as they were, and other
libraries' warnings print as before.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import torch
from IPython.utils.capture import capture_output

import nan_magic
from nan_magic.errors.warning_lines import watch_warning

#: Warnings printed as Python prints them outside pytest (which records them instead), its first three lines of a cell.
PRINTED = (
    "import sys, warnings; shown = warnings.catch_warnings(); shown.__enter__(); warnings.simplefilter('always')\n"
    "warnings.showwarning = lambda m, c, f, n, *_: sys.stderr.write(warnings.formatwarning(m, c, f, n))\n"
    "\n"
)
WARN_CELL = PRINTED + (
    "import torch; from torch import nn\n"
    "\n"
    "lin = nn.Linear(3, 1)\n"
    "with nan_magic.watch(lin, on_detect='warn'):\n"
    "    z = lin(torch.full((1, 3), float('inf')))\n"
    "warnings.warn('not ours', UserWarning)\n"
    "shown.__exit__(None, None, None)\n"
)


def test_a_warn_mode_event_in_a_cell_is_printed_at_cell_in_n_line_m(ip) -> None:
    ip.user_ns["nan_magic"] = nan_magic
    with capture_output() as captured:
        ip.run_cell(WARN_CELL)
    ours = [line for line in captured.stderr.splitlines() if "RuntimeWarning: first non-finite" in line]
    assert len(ours) == 1, captured.stderr
    assert re.match(r"Cell In\[\d+\], line 8: RuntimeWarning: first non-finite input\[0\]", ours[0]), ours
    assert "z = lin(torch.full((1, 3), float('inf')))" in captured.stderr  # the line's source, as Python shows it
    # Another library's warning from the same cell prints as Python prints it: its file, not the cell's name.
    (theirs,) = [line for line in captured.stderr.splitlines() if "UserWarning: not ours" in line]
    assert re.match(r"\S+:9: UserWarning: not ours", theirs) and not theirs.startswith("Cell In["), theirs


def test_a_nan_magic_warning_from_a_cell_is_named_by_the_cell(ip) -> None:
    ip.user_ns["NanMagicWarning"] = nan_magic.NanMagicWarning
    with capture_output() as captured:
        ip.run_cell(PRINTED + "warnings.warn('careful', NanMagicWarning)\nshown.__exit__(None, None, None)\n")
    assert re.match(r"Cell In\[\d+\], line 4: NanMagicWarning: careful\n", captured.stderr), captured.stderr


def test_the_category_and_the_filename_stay_for_filters_and_tests() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn(watch_warning("first non-finite output"), stacklevel=1)
        lin = torch.nn.Linear(3, 1)
        with nan_magic.watch(lin, on_detect="warn"):
            lin(torch.full((1, 3), float("inf")))
    assert [warning.category for warning in caught] == [RuntimeWarning, RuntimeWarning]
    assert all(warning.filename == __file__ for warning in caught), [warning.filename for warning in caught]
    # Out of a cell (a script, a test), the file is named as Python names it.
    text = warnings.formatwarning(caught[1].message, caught[1].category, caught[1].filename, caught[1].lineno)
    assert text.startswith(f"{__file__}:{caught[1].lineno}: RuntimeWarning: first non-finite"), text


def test_importing_nan_magic_leaves_pythons_warnings_alone() -> None:
    # The cell-named printer is held by the IPython extension only (magics.load): a script's warnings are untouched.
    code = "import warnings; f = warnings.formatwarning; import nan_magic; assert warnings.formatwarning is f"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_printer_the_user_installs_after_ours_stays_after_unload(ip) -> None:
    from nan_magic.errors.warning_lines import watch_warning as marked

    def theirs(message, category, filename, lineno, line=None):
        return "theirs: " + ours(message, category, filename, lineno, line)

    ours = warnings.formatwarning
    warnings.formatwarning = theirs
    try:
        ip.run_line_magic("unload_ext", "nan_magic")
        assert warnings.formatwarning is theirs  # not dropped by our taking back
        text = warnings.formatwarning(marked("m"), RuntimeWarning, "/tmp/ipykernel_1/2.py", 3)
        assert text.startswith("theirs: /tmp/ipykernel_1/2.py:3: RuntimeWarning: m"), text  # ours inert beneath
    finally:
        warnings.formatwarning = ours.__wrapped__ if hasattr(ours, "__wrapped__") else ours
        ip.run_line_magic("load_ext", "nan_magic")
