"""The watch's options, declared once.

Each option is one field of :class:`WatchConfig`: its name, type and
default, its documentation (the Parameters section of ``WatchConfig`` is
made from it) and how a command line spells it (its flags with their help).
From that one declaration come ``watch()``'s keyword options (checked by
:func:`config_from_options`), the magics' and the command line's argparse
options and their help (:data:`WATCH_OPTIONS`; IPython's ``magic_arguments``
is argparse underneath), and the config of parsed options
(:func:`config_from_args`). Stdlib only.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "OPTION_NAMES",
    "WATCH_OPTIONS",
    "OnDetect",
    "WatchConfig",
    "WatchMode",
    "config_from_args",
    "config_from_options",
    "option_entries",
]

OnDetect = Literal["raise", "warn", "log"]
WatchMode = Literal["tiered", "full"]

#: A command-line flag of an option: its spellings and ``add_argument`` keywords (``help`` among them).
Flag = tuple[tuple[str, ...], dict[str, Any]]


def _option(default: Any, doc: str, *flags: Flag) -> Any:
    """A :class:`WatchConfig` field: its default, its documentation and its command-line flags."""
    return field(default=default, metadata={"doc": doc, "flags": flags})


def _flag(*names: str, help: str, **argparse_keywords: Any) -> Flag:
    return names, {"help": help, **argparse_keywords}


class _OneOf(argparse.Action):
    """``store_const`` that refuses a second, different flag of the same option (``--warn --log``).

    With plain ``store_const`` the last flag won in silence: ``--warn --log`` logged without a word.
    The flags of such an option are spelled as their values (``--warn`` stores ``"warn"``).
    """

    def __init__(self, option_strings: list[str], dest: str, const: Any = None, **keywords: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, const=const, **keywords)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        current = getattr(namespace, self.dest, self.default)
        if current not in (self.default, self.const):
            raise argparse.ArgumentError(self, f"not allowed with --{current} (choose one)")
        setattr(namespace, self.dest, self.const)


def _comma_names(value: str) -> tuple[str, ...]:
    """``"nan, inf"`` -> ``("nan", "inf")``: a command line gives a list as one word."""
    return tuple(name.strip() for name in value.split(",") if name.strip())


@dataclass(frozen=True)
class WatchConfig:
    """Options of one watch; shared by the engine, the magics and the CLI."""

    on_detect: OnDetect = _option(
        "raise",
        """``"raise"`` (default) stops at the first non-benign event with
        :class:`nan_magic.NonFiniteError`; ``"warn"`` emits one warning per
        event and continues; ``"log"`` records silently and continues.""",
        _flag("--warn", action=_OneOf, const="warn", help="warn at each event and let the code continue"),
        _flag("--log", action=_OneOf, const="log", help="record events silently and let the code continue"),
    )
    mode: WatchMode = _option(
        "tiered",
        """``"tiered"`` (default): check the step's boundaries (the batch, the
        model's outputs, the loss, the gradients, the parameters) and, at an
        event, replay the failing step under per-module and op-level checks
        to name the producer; a per-module step every ``full_every`` steps
        feeds the per-layer early warnings. ``"full"``: check every module
        call of every step (``ops=True`` implies it).""",
        _flag("--full", action="store_const", const="full", help="check every module call of every step "
              "(default: the step's boundaries, and a replay of the failing step)"),
    )
    full_every: int = _option(
        50,
        """In the tiered mode, the watch's second step and every
        ``full_every``-th step after it are per-module steps.""",
    )
    kinds: frozenset[str] = _option(
        frozenset({"nan", "inf"}),
        """Which kinds count: any of ``"nan"`` and ``"inf"`` (``"inf"`` covers both
        signs).""",
        _flag("--kinds", type=_comma_names, metavar="KINDS", help="which kinds count: nan, inf or nan,inf (default)"),
    )
    include: tuple[str, ...] = _option(
        (),
        """``fnmatch`` patterns on qualified module names; a module is watched when
        it matches an include pattern (or none is given) and no exclude pattern.""",
        _flag("--include", action="append", default=[], metavar="PATTERN",
              help="watch only modules whose qualified name matches (fnmatch; repeatable)"),
    )
    exclude: tuple[str, ...] = _option(
        (),
        """``fnmatch`` patterns of modules to skip (see ``include``).""",
        _flag("--exclude", action="append", default=[], metavar="PATTERN",
              help="skip modules whose qualified name matches (fnmatch; repeatable)"),
    )
    types: tuple[str, ...] = _option(
        (),
        """Class names (``"Linear"``), qualified class names or classes to watch;
        empty means every type. The root module is always watched for data
        entering it.""",
        _flag("--types", type=_comma_names, metavar="TYPES",
              help="watch only these module types, comma-separated (e.g. Linear,LayerNorm)"),
    )
    log_file: str | None = _option(
        None,
        """A JSON-lines file that receives one line per event.""",
        _flag("--log-file", metavar="PATH", help="append one JSON line per event"),
    )
    defer: bool | None = _option(
        None,
        """Keep per-call results on the device and check them once per phase
        (``None``: automatic, on for CUDA tensors, and under a process group;
        with ``ops=True``, whose tracer reads every op as it runs, only under a
        process group). Results are identical; only the frame in which the error
        is raised differs.""",
        # Not "instead of per module": the default watch checks a step's boundaries, not every module call.
        _flag("--defer", action="store_true",
              help="keep the checks' results on the device, read together (default on CUDA)"),
    )
    ops: bool = _option(
        False,
        """Op-level tracing for the whole watched code.""",
        _flag("--ops", action="store_true", help="op-level tracing of every step (exact op and line; slower)"),
    )
    replay: bool = _option(
        True,
        """Re-run a producer module on its inputs under op-level tracing to name
        the op and the line: a forward producer as it was called, a backward
        producer's forward and backward from the gradient hook that found it
        (immediate mode only).""",
        _flag("--no-replay", action="store_false", help="do not replay the producer to find its op"),
    )
    fixes: bool = _option(
        True,
        """At a real event, try the remedies that fit its cause (float32 at the
        producer, an eps, the stable form) on copies of the failing step, within
        a few step-times, and list which made the step finite (``report.fixes``).""",
        _flag("--no-fixes", action="store_false", help="do not try remedies on a replay of the failing step"),
    )
    backward: bool = _option(
        True,
        """Check the gradients during backward: those flowing into the modules'
        outputs (a backward producer named with its op and line), and the
        parameter gradients of a backward no optimizer step follows. Off, the
        parameter gradients are still read before each optimizer step (which
        must not apply a non-finite one): such an event names the parameter's
        module, without the op.""",
        _flag("--no-backward", action="store_false",
              help="do not check gradients during backward (parameter gradients are still read before each "
                   "optimizer step)"),
    )
    history: int = _option(200, """How many steps of scalar history to keep.""")
    sample_size: int = _option(4096, """Finite values kept per tensor for histograms (producer only).""")
    max_layers: int = _option(2000, """Per-layer rows kept for the failing step (oldest dropped first).""")
    max_events: int = _option(100, """Events kept in ``watch.events``.""")
    dump: str | None = _option(
        None,
        """A folder: at the first real event, save the crash scene there.""",
        _flag("--dump", metavar="DIR", help="at the first real event, save the crash scene in DIR"),
    )
    keep_last_good: str | None = _option(
        None,
        """``"cpu"`` (or ``True``) or ``"device"``: keep the model's and
        optimizer's state from the last step that ended finite there, for
        ``report.restore()``, and the model's from the step before (the
        ``lr`` fix trial redoes the update between them).""",
        _flag("--keep-last-good", nargs="?", const="cpu", choices=["cpu", "device"],
              help="keep the state of the last finite step (on the cpu, default, or the device) for report.restore()"),
    )

    def __post_init__(self) -> None:
        if self.on_detect not in ("raise", "warn", "log"):
            raise ValueError(
                f"on_detect must be 'raise', 'warn' or 'log', not {self.on_detect!r}"
            )
        if self.mode not in ("tiered", "full"):
            raise ValueError(f"mode must be 'tiered' or 'full', not {self.mode!r}")
        kinds = frozenset(_names("kinds", self.kinds))
        unknown = kinds - {"nan", "inf"}
        if unknown or not kinds:
            raise ValueError(
                f"kinds must be a non-empty subset of {{'nan', 'inf'}}, not {sorted(kinds)!r}"
            )
        object.__setattr__(self, "kinds", kinds)
        for name in ("include", "exclude"):
            object.__setattr__(self, name, _names(name, getattr(self, name)))
        # A class is taken for its qualified name, which the type filter matches (engine/targets.py).
        types = (f"{t.__module__}.{t.__qualname__}" if isinstance(t, type) else t for t in _items("types", self.types))
        object.__setattr__(self, "types", _names("types", tuple(types), "class names or classes"))
        if isinstance(self.keep_last_good, bool):  # watch(keep_last_good=True) keeps it on the cpu
            object.__setattr__(self, "keep_last_good", "cpu" if self.keep_last_good else None)
        if self.keep_last_good not in (None, "cpu", "device"):
            raise ValueError(f"keep_last_good must be 'cpu', 'device' or None, not {self.keep_last_good!r}")
        for name in ("history", "sample_size", "max_layers", "max_events", "full_every"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise TypeError(f"{name} must be an integer, not {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be at least 1, not {value!r}")
        for name in ("ops", "replay", "fixes", "backward", "defer"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "defer" and value is None):
                allowed = "True, False or None" if name == "defer" else "True or False"
                raise TypeError(f"{name} must be {allowed}, not {value!r}")
        for name in ("log_file", "dump"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (str, os.PathLike)):
                    raise TypeError(f"{name} must be a path, not {value!r}")
                object.__setattr__(self, name, os.fspath(value))

    @property
    def tiered(self) -> bool:
        """Whether steps are checked at their boundaries only (``ops=True`` checks every op of every step)."""
        return self.mode == "tiered" and not self.ops


def option_entries() -> list[str]:
    """Each option's numpy-style entry (its name, then its ``doc`` indented), from its one declaration: the lines
    of WatchConfig's Parameters section and of ``watch()``'s (``watch?``), at the indent of a class's docstring."""
    lines = []
    for option in dataclasses.fields(WatchConfig):
        lines.append(f"    {option.name}")
        lines.extend(f"        {line.strip()}" for line in option.metadata["doc"].splitlines())
    return lines


WatchConfig.__doc__ = (WatchConfig.__doc__ or "") + "\n".join(["", "", "    Parameters", "    ----------",
                                                                *option_entries()]) + "\n"

#: The option names, in declaration order.
OPTION_NAMES: tuple[str, ...] = tuple(option.name for option in dataclasses.fields(WatchConfig))

#: ``(flags, add_argument keywords)`` of every watch option that a command line spells: each
#: stores into its field's name, with its field's default.
WATCH_OPTIONS: list[Flag] = [
    (names, {"dest": option.name, "default": option.default, **keywords})
    for option in dataclasses.fields(WatchConfig)
    for names, keywords in option.metadata["flags"]
]


def config_from_options(options: Mapping[str, Any]) -> WatchConfig:
    """The :class:`WatchConfig` of keyword options; an unknown name is a one-line TypeError naming it.

    Raises
    ------
    TypeError, ValueError
        For an unknown option or a value the config refuses (one line).
    """
    for name in options:
        if name not in OPTION_NAMES:
            close = difflib.get_close_matches(name, OPTION_NAMES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; its options are {', '.join(OPTION_NAMES)}"
            raise TypeError(f"watch() got an unexpected keyword argument {name!r}{hint}")
    return WatchConfig(**options)


def config_from_args(args: Any) -> WatchConfig:
    """The :class:`WatchConfig` of options parsed with :data:`WATCH_OPTIONS`.

    Raises
    ------
    ValueError
        For an option value the config refuses (one line, for a usage error).
    """
    spelled = {keywords["dest"] for _names, keywords in WATCH_OPTIONS}
    return WatchConfig(**{name: getattr(args, name) for name in spelled})


def _items(name: str, value: Any) -> tuple[Any, ...]:
    """A config list given as one string (``kinds="nan"``) or one class (``types=nn.Linear``) is one item."""
    if isinstance(value, (str, type)):
        return (value,)
    try:
        return tuple(value)
    except TypeError:  # None, a number: say which option, not "'NoneType' object is not iterable"
        raise TypeError(f"{name} must be a string or a list of them, not {value!r}") from None


def _names(name: str, value: Any, what: str = "strings") -> tuple[str, ...]:
    items = _items(name, value)
    wrong = [item for item in items if not isinstance(item, str)]
    if wrong:
        raise TypeError(f"{name} must be {what}, not {wrong[0]!r}")
    return items
