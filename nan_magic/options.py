"""The watch options shared by the magics and the command line.

Both front ends parse with argparse (IPython's ``magic_arguments`` is argparse
underneath), so one list of ``add_argument`` specs serves both, and one
function turns the parsed options into a :class:`WatchConfig`. Stdlib only.
"""

from __future__ import annotations

from typing import Any

from nan_magic.records import WatchConfig

__all__ = ["WATCH_OPTIONS", "config_from_args"]

#: ``(flags, add_argument keyword arguments)`` of every watch option.
WATCH_OPTIONS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--warn",), {"action": "store_const", "const": "warn", "dest": "on_detect",
                   "help": "warn at each event and let the code continue"}),
    (("--log",), {"action": "store_const", "const": "log", "dest": "on_detect",
                  "help": "record events silently and let the code continue"}),
    (("--kinds",), {"default": "nan,inf", "help": "which kinds count: nan, inf or nan,inf (default)"}),
    (("--include",), {"action": "append", "default": [], "metavar": "PATTERN",
                      "help": "watch only modules whose qualified name matches (fnmatch; repeatable)"}),
    (("--exclude",), {"action": "append", "default": [], "metavar": "PATTERN",
                      "help": "skip modules whose qualified name matches (fnmatch; repeatable)"}),
    (("--types",), {"default": "", "metavar": "TYPES",
                    "help": "watch only these module types, comma-separated (e.g. Linear,LayerNorm)"}),
    (("--log-file",), {"default": None, "metavar": "PATH", "help": "append one JSON line per event"}),
    (("--full",), {"action": "store_const", "const": "full", "default": "tiered", "dest": "mode",
                   "help": "check every module call of every step (default: the step's boundaries, and a replay "
                   "of the failing step)"}),
    (("--ops",), {"action": "store_true", "help": "op-level tracing of every step (exact op and line; slower)"}),
    (("--no-replay",), {"action": "store_true", "help": "do not replay the producer to find its op"}),
    (("--no-backward",), {"action": "store_true", "help": "do not check gradients"}),
    (("--defer",), {"action": "store_true", "default": None,
                    "help": "check once per step instead of per module (default on CUDA)"}),
    (("--dump",), {"default": None, "metavar": "DIR",
                   "help": "at the first real event, save the crash scene in DIR"}),
    (("--keep-last-good",), {"nargs": "?", "const": "cpu", "default": None, "choices": ["cpu", "device"],
                             "help": "keep the state of the last finite step (on the cpu, default, or the "
                             "device) for report.restore()"}),
]


def _names(value: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in value.split(",") if name.strip())


def config_from_args(args: Any) -> WatchConfig:
    """The :class:`WatchConfig` of parsed :data:`WATCH_OPTIONS`.

    Raises
    ------
    ValueError
        For an option value the config refuses (one line, for a usage error).
    """
    return WatchConfig(
        on_detect=args.on_detect or "raise",
        mode=args.mode,
        kinds=frozenset(_names(args.kinds)),
        include=tuple(args.include),
        exclude=tuple(args.exclude),
        types=_names(args.types),
        log_file=args.log_file,
        defer=args.defer,
        ops=args.ops,
        replay=not args.no_replay,
        backward=not args.no_backward,
        dump=args.dump,
        keep_last_good=args.keep_last_good,
    )
