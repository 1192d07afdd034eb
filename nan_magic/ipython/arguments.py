"""The words of a magic's line, as the magics read them, and its help as ``%%nantrace?`` shows it.

IPython's ``magic_arguments`` splits the line like a shell but keeps a quoted word's quotes, and
separates targets by spaces only; these helpers make the words what a user typing them means.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from IPython.core.magic_arguments import MagicHelpFormatter

__all__ = ["MagicHelp", "target_names", "unquoted_options"]


class MagicHelp(MagicHelpFormatter):
    """IPython's help layout of a magic, laid out as argparse lays out any command's.

    IPython gives its usage line the prefix ``::`` (a code block) and two blank lines, which argparse counts as
    columns of the usage line: the continuation lines stood 4 columns right of the first option. And IPython wraps
    an option's argument that is not one word in ``<>`` for reStructuredText, which ``?`` shows as text:
    ``--keep-last-good <[{cpu,device}]>``, where the usage line says ``[--keep-last-good [{cpu,device}]]``."""

    def add_usage(self, usage: Any, actions: Any, groups: Any, prefix: Any = None) -> None:
        argparse.RawDescriptionHelpFormatter.add_usage(self, usage, actions, groups, "  %")

    def _format_usage(self, usage: Any, actions: Any, groups: Any, prefix: Any) -> str:
        return "::\n\n" + super()._format_usage(usage, actions, groups, prefix)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        return argparse.RawDescriptionHelpFormatter._format_action_invocation(self, action)

_DOTTED_NAME = re.compile(r"[A-Za-z_][\w.]*")


def unquoted_options(args: Any) -> Any:
    """``args`` with each option's value (not the targets, which are Python) out of one pair of quotes.

    ``--include 'encoder.*'`` gave the pattern ``"'encoder.*'"``, which matches no module.
    """
    for option, value in vars(args).items():
        if option != "targets":
            setattr(args, option, [_unquoted(item) for item in value] if isinstance(value, list) else _unquoted(value))
    return args


def _unquoted(value: Any) -> Any:
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def target_names(targets: list[str]) -> list[str]:
    """``model, opt`` as Python reads a list: between names a comma separates, as a space does.

    ``["model,"]`` -> ``["model"]``, ``["model,opt"]`` -> ``["model", "opt"]``; an expression keeps its own
    commas (``models[0,1]``, ``get(a, b)``).
    """
    return [name for target in targets for name in _names_or_expression(target)]


def _names_or_expression(target: str) -> list[str]:
    names = [name for name in target.split(",") if name]
    return names if all(_DOTTED_NAME.fullmatch(name) for name in names) else [target]
