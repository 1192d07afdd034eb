"""Whose hooks these are: one attribute a hook reads instead of asking the watch.

torch's hooks are global: every hook asks whether the call is the watch's own
(the thread that entered it, the watch active, no replay of ours running), ten
times a step. ``HookOwner.mine`` is that answer, kept as a per-thread attribute
and set only where it changes (the watch entered and left, a replay standing
aside), so the hot path reads it with no Python call (a method and
``threading.get_ident()`` were two calls each time).
"""

from __future__ import annotations

import threading

__all__ = ["HookOwner"]


class HookOwner(threading.local):
    """``mine``: True on the thread that entered the watch while it is active and not replaying; False on any
    other thread (autograd's own, a DataLoader's), whose value is the class's."""

    mine = False
