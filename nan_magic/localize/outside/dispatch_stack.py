"""Where the loop-code recorder sits on torch's dispatch-mode stack: pushed, popped, stepped aside, taken off.

Apart from outside/recorder.py, which holds what the recorder records (its
regions, budgets and records, and the dispatch that records an op), because
this is the one concern that talks to torch's mode stack and key set directly:
:class:`OnTheDispatchStack` is the mixin :class:`~nan_magic.localize.outside.recorder.OutsideRecorder`
gets these methods from (the same functions, so no call more a step).

The recorder is pushed only onto an empty dispatch-mode stack and popped only
when innermost (a mode the user entered since stays; ours waits, inert). An
``inference_mode`` block restores the dispatch-key set at its end, Python key
included: its ``__exit__`` puts that key in step with the stack while the
watch records (patches/inference_blocks.py), so the recorder steps aside
inside such blocks as outside. Inside a guard that patch does not see
(``torch._C._InferenceMode``) it is neither pushed nor popped, and stays
pushed, inert, through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from nan_magic.patches.inference_blocks import BLOCKS, as_blocks_set

__all__ = ["OnTheDispatchStack"]

# The budget of a recorder that passes every op through (spent, or stopped under a mode entered since).
_INERT = -1
# torch's dispatch-mode stack, called directly (``_push_mode``/``_pop_mode`` are a Python frame more each).
_push, _pop = torch._C._push_on_torch_dispatch_stack, torch._C._pop_torch_dispatch_stack
_stack_depth, _stack_at = torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at
_inference = torch.is_inference_mode_enabled
_key_on, _set_key = torch._C._dispatch_tls_is_dispatch_key_included, torch._C._dispatch_tls_set_dispatch_key_included
_PYTHON, _PYTHON_SNAPSHOT = torch._C.DispatchKey.Python, torch._C.DispatchKey.PythonTLSSnapshot


class OnTheDispatchStack:
    """Pushes and pops the recorder (the attributes are :class:`OutsideRecorder`'s, set by its ``__init__``)."""

    pushed: bool
    apart: bool
    batches_aside: bool
    _resumes: bool
    _watch_inferring: bool
    _budget: int
    _region: str
    untraced: set[str]

    if TYPE_CHECKING:
        def start(self, region: str, entry: bool = False, goes_on: Callable[[], bool] | None = None) -> None: ...

    def _push(self) -> None:
        # (as_blocks_set, inlined: three pushes and pops a step)
        if (not self.pushed and _stack_depth() == 0 and not self.apart
                and _inference() == (blocks[-1][1] if (blocks := BLOCKS.open) else self._watch_inferring)):
            _push(self)  # type: ignore[arg-type]  # (OutsideRecorder, the TorchDispatchMode this mixes into)
            self.pushed = True

    def stop(self) -> None:
        """Stop recording (a model call, ``backward()`` or an optimizer step begins, or the watch ends)."""
        if not self.pushed:
            return
        # (As step_aside pops, inlined: three a step.)
        if _inference() == (blocks[-1][1] if (blocks := BLOCKS.open) else self._watch_inferring):
            try:
                mode = _pop(None)
            except RuntimeError:  # an empty stack: pushed on another thread's
                mode = None
            if mode is self:
                self.pushed = False
                return
            if mode is not None:
                _push(mode)
        self._budget = _INERT  # left on the stack, inert until it is on top

    def step_aside(self) -> bool:
        """Popped, where it may be (True): for :meth:`stop`, and for a call that runs none of the loop's code
        (``zero_grad()``: patches/zero_grad.py), after which :meth:`step_back` pushes it again.

        Only where this recorder is this thread's innermost mode (a mode the
        user entered since stays balanced; another thread's stack holds none
        of ours), and not inside an inference-mode guard the watch does not
        see, whose end puts the Python key back (the module docstring).
        """
        if self.pushed and _inference() == (blocks[-1][1] if (blocks := BLOCKS.open) else self._watch_inferring):
            # The top mode popped, and put back where it is not this recorder (a mode entered since, or another
            # thread's stack; an infra mode goes back to its slot): two calls to torch, not four (its depth and top).
            try:
                mode = _pop(None)
            except RuntimeError:  # an empty stack: pushed on another thread's
                mode = None
            if mode is self:
                self.pushed = False
                return True
            if mode is not None:
                _push(mode)
        return False

    def take_off(self) -> None:
        """:meth:`stop` as the watch's hooks come off, and off this thread's stack even from under a mode the user
        left open past the watch (inert there, it would pass every op through its trampoline after the watch)."""
        self.stop()
        if not self.pushed or not as_blocks_set(self._watch_inferring):
            return
        if not any(_stack_at(index) is self for index in range(_stack_depth())):
            return  # (pushed on another thread's stack: the watch ends on this one)
        above = []
        while (mode := _pop(None)) is not self:
            above.append(mode)
        self.pushed = False
        for mode in reversed(above):
            _push(mode)

    def step_aside_for_batch(self) -> bool:  # (a DataLoader's fetch, once a data region ran over budget)
        return self.batches_aside and self._region == "data" and self.step_aside()

    step_back = _push  # pushed again after step_aside, as start pushes (the same function: no call more a step)

    def data_mark(self) -> tuple[bool, bool, int]:
        """The data region as an optimizer's step post-hooks begin (hot/step_cycle.py): whether it was over its
        budget, whether batches were fetched aside, its budget left; :meth:`data_after_hooks` puts them back."""
        return "data" in self.untraced, self.batches_aside, self._budget

    def data_after_hooks(self, mark: tuple[bool, bool, int], keep: bool, aside: bool) -> None:
        """The user's step post-hooks ran, recorded in the data region begun before them: the loop's data code after
        them keeps the budget it had (a healthy max-norm constraint over every layer runs a hundred ops at every
        step; they are not to leave the data code unrecorded for the rest of the run).

        ``keep``: their records name the parameters they wrote, held for the deferred check: they stay, and the budget
        is what it was as they began. Else, or where their ops ran over the budget (their records gone with it),
        the region starts afresh. ``aside``: the recorder was stepped aside for the watch's reads (step_aside).
        A data region over its budget before the hooks stays so: its own code ran over it.
        """
        was_untraced, was_aside, budget = mark
        if not was_untraced and ("data" in self.untraced or not keep):
            self.untraced.discard("data")
            self.batches_aside = was_aside  # (a DataLoader's fetch did not run over it: the hooks did)
            self.start("data")
            return
        if keep and not was_untraced and self._budget > 0:
            self._budget = budget
        if aside:
            self.step_back()

    def pause(self) -> None:
        """:meth:`stop` as the watch is left; :meth:`resume` records on if it was recording (watch.resume).

        The first thing the watch does as it is left: where a guard that restores the key set ended after the
        recorder was popped inside it, unseen (``torch._C._InferenceMode(False)`` entered directly in the watch's
        own mode: no flag tells it from outside), the Python key is on over an empty stack, and is put off before
        any op runs.
        """
        self._resumes = self.pushed
        self.stop()
        if _stack_depth() == 0 and _key_on(_PYTHON):
            _set_key(_PYTHON, False)
            _set_key(_PYTHON_SNAPSHOT, False)

    def resume(self) -> None:
        """Record on after :meth:`pause`, keeping the records and the budget (the watch's run goes on)."""
        self._watch_inferring = _inference()
        if self._resumes:
            self._push()
