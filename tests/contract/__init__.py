"""The contract table: every fault and every healthy idiom, with what the report must say.

Each module of this package holds the cases of one area in a list ``CASES``;
``tests/test_contract.py`` runs every case in each of its modes (the default
tiered watch, immediate and ``defer=True``, ``mode="full"`` and ``ops=True``) and asserts what a user would see: the
phase, the module and its type, the step, the op and the source line (marked
in the case's own file with a ``# producer: <key>`` comment), and for a healthy
idiom that the watch stays silent and changes nothing.

A case is a :class:`Case`. Its ``build()`` returns a :class:`Scenario`: the
objects to pass to ``watch`` (possibly none, for the discovering watch) and a
``run()`` that executes the code once and returns a value to compare with an
unwatched run (for a silent case, results must be bit-identical).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nan_magic.records import TensorRef

MODES = ("default", "defer", "full", "ops")

# What each mode passes to watch(): the tiered default (immediate, and deferred as on CUDA), the
# per-module watch of every step, and op-level tracing of every step (immediate, and deferred: what ops=True
# gives on CUDA).
MODE_OPTIONS: dict[str, dict[str, Any]] = {
    "default": {}, "defer": {"defer": True}, "full": {"mode": "full"}, "ops": {"ops": True},
    "ops-defer": {"ops": True, "defer": True},
}
#: A mode that must say what another says, wherever a case runs that one: only the timing differs.
TIMED_LIKE = {"ops-defer": "ops"}


def modes_of(case: Case) -> tuple[str, ...]:
    """The modes ``case`` runs in: its own, and each timed like one of them."""
    return (*case.modes, *(mode for mode, like in TIMED_LIKE.items() if like in case.modes))


@dataclass
class Scenario:
    """What a case runs: ``watch(*targets, **options)`` around ``run()``."""

    targets: tuple[Any, ...]
    run: Callable[[], Any]
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Expect:
    """What the report of the first non-benign event must say.

    ``marker`` names the ``# producer: <key>`` comment on the producer's source
    line, in the file that defines the case's ``build`` (or ``marker_file``'s
    module). ``op_modes`` lists the modes in which op and line are asserted
    (a mode left out is a known gap, stated in the case's ``note``).
    ``tensor`` is ``report.tensor``, the typed reference of the tensor that went bad.
    """

    phase: str
    module: str | None
    module_type: str | None = None
    step: int = 0
    op: str | None = None
    marker: str | None = None
    kinds: frozenset[str] | None = None
    tensor: TensorRef | None = None
    cause: str | None = None
    op_modes: tuple[str, ...] = MODES
    benign_events: int | None = None  # benign events recorded before the real one, where it matters
    # ``(mode, words)``: the report's text in that mode says ``words`` (why a mode names less than the others).
    says: tuple[tuple[str, str], ...] = ()
    # ``report.model``: which of several watched models (its label: ``Sequential#2`` for the second of one class).
    model: str | None = None


@dataclass(frozen=True)
class Case:
    """One row of the contract table; ``expect=None`` means silent (a healthy idiom)."""

    name: str
    build: Callable[[], Scenario]
    expect: Expect | None
    modes: tuple[str, ...] = MODES
    # For a silent case: how many benign events it must record (None: any number).
    benign: int | None = None
    note: str = ""
    marks: tuple[Any, ...] = ()
    # The module whose source holds the ``# producer:`` markers (default: the one defining ``build``).
    source: Any = None
    # ``(mode, why)``: a mode timed like another (TIMED_LIKE) that does not say what that one says yet, a strict
    # xfail with its reason.
    gaps: tuple[tuple[str, str], ...] = ()


def source_line(case: Case, key: str) -> tuple[str, int]:
    """(file, line) of ``# producer: key`` in the module that defines ``case.build``."""
    module = case.source or inspect.getmodule(case.build)
    assert module is not None and module.__file__ is not None
    lines = inspect.getsource(module).splitlines()
    matches = [n for n, text in enumerate(lines, 1) if text.rstrip().endswith(f"# producer: {key}")]
    assert len(matches) == 1, f"marker {key!r} found {len(matches)} times in {module.__name__}"
    return module.__file__, matches[0]


def all_cases() -> list[Case]:
    """Every case of every module in this package, in module order."""
    cases: list[Case] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        cases.extend(getattr(module, "CASES", []))
    names = [case.name for case in cases]
    assert len(names) == len(set(names)), "two contract cases share a name"
    return cases
