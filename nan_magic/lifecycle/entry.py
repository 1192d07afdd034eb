"""``nan_magic.watch()``: the public way to make a :class:`Watch`, its options declared once (WatchConfig)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable
from typing import Any

from nan_magic.lifecycle.watch import Watch
from nan_magic.options import WatchConfig, config_from_options

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
    **options
        Any option of :class:`nan_magic.WatchConfig`, by name (``on_detect``,
        ``mode``, ``kinds``, ``include``, ``keep_last_good``...; each one is
        documented there). An unknown name is a TypeError naming it.

    Returns
    -------
    Watch
        A context manager and decorator; ``.report`` and ``.events`` afterwards.

    Examples
    --------
    >>> with nan_magic.watch(model) as w:          # doctest: +SKIP
    ...     loss = model(x).sum(); loss.backward()
    """
    return Watch(targets, labels=labels, config=config_from_options(options))


# help(), IDEs and inspect show every option with its default, from WatchConfig's one declaration.
watch.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
    inspect.Parameter("targets", inspect.Parameter.VAR_POSITIONAL, annotation="Any"),
    inspect.Parameter("labels", inspect.Parameter.KEYWORD_ONLY, default=None,
                      annotation="Iterable[str | None] | None"),
    *(inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=option.default, annotation=option.type)
      for option in dataclasses.fields(WatchConfig)),
], return_annotation="Watch")
