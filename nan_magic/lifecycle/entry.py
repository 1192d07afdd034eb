"""``nan_magic.watch()``: the public way to make a :class:`Watch`, its options declared once (WatchConfig)."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Iterable
from typing import Any

from nan_magic.lifecycle.watch import Watch
from nan_magic.options import WatchConfig, config_from_options, option_entries

__all__ = ["watch"]


def watch(*targets: Any, labels: Iterable[str | None] | None = None, **options: Any) -> Watch:
    """Watch models, optimizers and GradScalers for the first non-finite value.

    Parameters
    ----------
    *targets
        ``nn.Module``, ``torch.optim.Optimizer`` or ``GradScaler`` objects. With
        no module, every module called at top level is watched.
    labels
        Names for the targets (the magics pass variable names), one per target.
    OPTIONS

    Returns
    -------
    Watch
        A context manager and decorator; ``.report`` and ``.events`` afterwards.

    Raises
    ------
    TypeError, ValueError
        An option this watch has not (named, with the closest one), or a value it refuses.

    Examples
    --------
    >>> with nan_magic.watch(model) as w:          # doctest: +SKIP
    ...     loss = model(x).sum(); loss.backward()
    """
    return Watch(targets, labels=labels, config=config_from_options(options))


# help(), ``watch?``, IDEs and inspect show every option with its default and its type as a user reads it
# (``Literal['raise', 'warn', 'log']``, not the alias's name ``'OnDetect'``), and the docstring documents each once
# (an unknown name is a TypeError naming it), all from WatchConfig's one declaration.
_TYPES = typing.get_type_hints(WatchConfig)
watch.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
    inspect.Parameter("targets", inspect.Parameter.VAR_POSITIONAL, annotation=Any),
    inspect.Parameter("labels", inspect.Parameter.KEYWORD_ONLY, default=None,
                      annotation=typing.get_type_hints(watch)["labels"]),
    *(inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=option.default,
                        annotation=_TYPES[option.name]) for option in dataclasses.fields(WatchConfig)),
], return_annotation=Watch)
watch.__doc__ = (watch.__doc__ or "").replace("    OPTIONS\n", "\n".join(option_entries()) + "\n")
