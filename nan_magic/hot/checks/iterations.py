"""Which training iteration an event belongs to, counted from the optimizer steps seen.

PRODUCT.md's *step* is the 0-based index of the training iteration. With one
optimizer that is its steps completed. With several that take turns in one
iteration (a GAN's discriminator then generator; an encoder's and a decoder's
optimizers), counting every step, or the most-stepped optimizer's, runs ahead:
the generator's backward in iteration 3 comes after the discriminator's fourth
step. So an iteration is counted complete when every optimizer that takes part
in it (its *members*) has stepped:

* the members are the optimizers passed to the watch; where none was passed,
  the first optimizer seen stepping, joined by any optimizer whose first step
  comes right after an iteration completed, before a member stepped again (a
  GAN's generator, whose discriminator steps first). Unpassed, the generator
  is unknown until its first step, so the rest of iteration 0 counts as step 1;
* an optimizer that steps again before every member has (a WGAN's critic
  stepping five times a generator step, a passed optimizer that stops
  stepping) closes the iteration there: the members are then those that did
  step, so a member that stops stepping costs at most one iteration's lag;
* a member so left out becomes *occasional* (a body optimizer stepping every
  2nd iteration beside a head's every one): its later steps count in the
  iteration they come in (after the members', in the one just closed) and
  neither complete nor close one, so it costs that one iteration's lag once,
  not every time it is absent. An occasional optimizer stepping twice with no
  member stepping between (the members stopped: the head alone, then the body
  alone) is a member again, in the others' place;
* a new optimizer over a member's parameters (the loop switched from Adam to SGD) takes that member's place
  from its first step, which starts the next iteration: it does not join the one just closed, as a GAN's
  generator (whose parameters are its own) does.

* optimizers stepping with no backward between their steps (a head's and a body's, the body every k-th iteration,
  before or after the head; one that starts after a warmup) share that backward: one iteration. The later one is
  *tied* to the first (counted as one member from then on), whichever of them opens a later iteration; a passed
  optimizer that has not stepped yet is tied so at the first step of one whose loop calls its ``step()`` with no
  ``backward`` between the two calls (step_sites.py), where a GAN's generator, after its own backward, is not;
* an optimizer stepping in an inner loop of the loop that steps another (a WGAN's critic, ``n_critic`` steps before
  each generator step; seen at the other's first step, from the two ``step()`` call sites' loops) is *inner*: its
  steps belong to the iteration they come in and neither close nor complete one. Its steps before the other's first
  counted as iterations until then (the first iteration's later critic steps), and are taken back then.

A step a GradScaler skips is not an optimizer step, as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import CodeType, FrameType

import torch

from nan_magic.hot.checks.step_sites import loops_of as _loops
from nan_magic.hot.checks.step_sites import site as _site
from nan_magic.hot.checks.step_sites import stepped_nearby as _stepped_nearby
from nan_magic.hot.checks.step_sites import steps_another_outside as _steps_another_outside

__all__ = ["Iterations"]


class Iterations:
    """Training iterations completed, from optimizer steps (see the module docstring)."""

    def __init__(self, passed: Iterable[torch.optim.Optimizer] = ()) -> None:
        #: Training iterations completed.
        self.completed = 0
        self._members: set[int] = {id(opt) for opt in passed}
        self._passed = {id(opt): opt for opt in passed}
        self._round: set[int] = set()
        # Members left out of an iteration (they step less often), and those of them that stepped since a member did.
        self._occasional: set[int] = set()
        self._aside: set[int] = set()
        # Every optimizer seen stepping, held so that its id stays its own for the watch's life.
        self._seen: dict[int, torch.optim.Optimizer] = {}
        #: Whether any optimizer stepped (an attribute, not a property: every top-level call asks).
        self.any_stepped = False
        # Steps with no backward between are one iteration's: the backwards at the last step, that step's optimizer
        # (its tie), the iteration it was counted in, and whether it was its first step, counted as a late newcomer.
        self._backwards = -1
        self._last: int | None = None
        self._last_raw: int | None = None
        self._unit: set[int] = set()  # the optimizers that stepped since the last backward
        self._index = 0
        self._opened_first = False
        #: Optimizers tied to another (stepping with no backward between): counted as that one.
        self._tie: dict[int, int] = {}
        # Optimizers stepping in an inner loop (a WGAN's critic), the run of one optimizer's steps just counted (its
        # optimizer, length, and the iterations completed before it), and each optimizer's step call site.
        self._inner: set[int] = set()
        self._run_key: int | None = None
        self._run_len = 0
        self._run_start = 0
        self._sites: dict[int, tuple[CodeType, int] | None] = {}

    def stepped(self, opt: torch.optim.Optimizer, backwards: int = -1) -> int:
        """Count a step of ``opt``; the index of the iteration it belongs to. ``backwards``: the backwards run so far
        (a step with none run since the last step joins that step's iteration); -1, not known."""
        key = id(opt)
        first = key not in self._seen
        self._seen[key] = opt
        self.any_stepped = True
        if first:
            self._sites[key] = (site := _site()) and site[:2]
            if site is not None and self._passed.keys() - self._seen.keys() - self._tie.keys():
                self._tie_unstepped(key, site)
        # (An optimizer stepping again with no backward between, its gradients set by hand: a new iteration's.)
        joins = backwards >= 0 and backwards == self._backwards and self._last_raw is not None and key not in self._unit
        self._backwards, self._last_raw = backwards, key
        if joins:
            self._unit.add(key)
            return self._join(key, first)
        self._unit = {key}
        if self._tie and key in self._tie:  # (none, most loops: no call)
            key, first = self._tie[key], False  # (counted as the optimizer it is tied to, seen already)
        if key in self._inner:  # (none, most loops: one test of an empty set)
            self._last, self._index, self._opened_first = key, self.completed, False
            return self.completed
        if first and self._run_key is not None and self._run_len > 1 and self._is_inner(self._run_key, key):
            return self._inner_found(key)
        if key == self._run_key:
            self._run_len += 1
            if self._run_len == 2 and _steps_another_outside(_site(), opt):
                return self._made_inner(key)
        else:
            self._run_key, self._run_len, self._run_start = key, 1, self.completed
        # (The member rule below, inlined: every step.)
        replaced = self._replaced_by(opt) if first and self._members else set()
        if replaced:
            self._members -= replaced
            self._round -= replaced
            self._occasional -= replaced
            self._members.add(key)
        elif first and not self._round and (self.completed or not self._members) and key not in self._occasional:
            # A newcomer right after an iteration closed (or the very first step): it takes part.
            late = bool(self.completed) and bool(self._members)
            self._members.add(key)
            if late:  # its step belongs to the iteration just closed
                self._last, self._index, self._opened_first = key, self.completed - 1, True
                return self.completed - 1
        if key in self._occasional:  # (none, most loops: one test of an empty set)
            if key not in self._aside:
                self._aside.add(key)  # in the iteration it comes in: after the members', the one just closed
                index = self.completed - 1 if self.completed and not self._round else self.completed
                self._last, self._index, self._opened_first = key, index, first and index < self.completed
                return index
            # Twice with no member between: the members stopped, and its last step was an iteration of its own; it
            # takes their place, from a new iteration.
            self._occasional = (self._occasional | self._members) - {key}
            self._members, self._round = {key}, set()
            self.completed += 1
        if self._aside:
            self._aside.clear()
        if key in self._round:
            # It steps again before every member has: the iteration closed without the others.
            self._close()
        index = self.completed
        self._round.add(key)
        if self._members <= self._round:  # (_close, inlined: the usual step closes its iteration)
            self._members, self._round = self._round, set()
            self.completed += 1
        self._last, self._index, self._opened_first = key, index, False
        return index

    def _join(self, key: int, first: bool) -> int:
        """A step after another with no backward between: the same iteration's (module docstring)."""
        last = self._last
        assert last is not None
        tied = self._tie.get(key, key)
        if tied != last and (first or self._opened_first):
            # One of the two steps for the first time: tied, the established one (the earlier) counting for both.
            keep, gone = (last, tied) if first else (tied, last)
            self._tie[gone] = keep
            for tied_key, to in list(self._tie.items()):
                if to == gone:
                    self._tie[tied_key] = keep
            self._members.discard(gone)
            self._occasional.discard(gone)
            self._aside.discard(gone)
            if gone in self._round:
                self._round.discard(gone)
                self._round.add(keep)
            if self._opened_first and not first:  # the opener was counted as a late newcomer: it is this member
                self._members.add(keep)
                self._index = self.completed
            last, tied = keep, keep
        if last in self._inner or tied in self._inner:
            return self._index
        if self._index < self.completed or not self._members:
            return self._index  # the iteration completed with the first of the two
        self._round.add(tied)
        if self._members <= self._round:
            self._members, self._round = self._round, set()
            self.completed += 1
        return self._index

    def _tie_unstepped(self, key: int, site: tuple[CodeType, int, FrameType]) -> None:
        """Tie to ``key`` the passed optimizers that have not stepped yet whose ``step()`` the loop around ``key``'s
        calls with no ``backward`` between the two calls (a body's optimizer that starts after a warmup): the
        iteration is then complete without them, where a GAN's generator, stepped after its own backward, is not."""
        unstepped = {id(other): other for other in _stepped_nearby(site)} if self._passed else {}
        for other_key in unstepped.keys() & (self._passed.keys() - self._seen.keys() - self._tie.keys()):
            if other_key != key and self._tie.get(key, key) == key:
                self._tie[other_key] = key
                self._members.discard(other_key)
                self._members.add(key)

    def _made_inner(self, key: int) -> int:
        """``key`` stepped twice in a row from a loop whose enclosing loop steps another optimizer: inner (module
        docstring). The iteration its first step completed, or closed, is taken back."""
        self._inner.add(key)
        self.completed = self._run_start
        self._members.discard(key)
        self._round.discard(key)
        self._occasional.discard(key)
        self._last, self._index, self._opened_first = key, self.completed, False
        return self.completed

    def _is_inner(self, inner: int, outer: int) -> bool:
        """Whether ``inner``'s step call sits in a loop inside the innermost loop of ``outer``'s (same function)."""
        site, other = self._sites.get(inner), self._sites.get(outer)
        if site is None or other is None or site[0] is not other[0]:
            return False
        loops = _loops(site[0])
        around = [loop for loop in loops if loop[0] <= other[1] <= loop[1]]
        if not around:
            return False
        start, end = min(around, key=lambda loop: loop[1] - loop[0])
        return start <= site[1] <= end and any(
            loop[0] <= site[1] <= loop[1] and not loop[0] <= other[1] <= loop[1] for loop in loops)

    def _inner_found(self, key: int) -> int:
        """``key``'s first step ends the first iteration of a loop whose inner loop stepped the run's optimizer."""
        inner = self._run_key
        assert inner is not None
        self._inner.add(inner)
        index = self._run_start
        self.completed = index + 1
        self._members, self._round = {key}, set()
        self._occasional.discard(key)
        self._occasional.discard(inner)
        self._run_key, self._run_len, self._run_start = key, 1, index
        self._last, self._index, self._opened_first = key, index, False
        return index

    def _replaced_by(self, opt: torch.optim.Optimizer) -> set[int]:
        """The members whose parameters ``opt`` steps too (asked once per optimizer, at its first step)."""
        mine = {id(parameter) for group in opt.param_groups for parameter in group["params"]}
        return {key for key in self._members
                if (member := self._seen.get(key) or self._passed.get(key)) is not None
                and any(id(parameter) in mine for group in member.param_groups for parameter in group["params"])}

    def absorb(self, inner: Iterations) -> None:
        """Add the iterations a nested watch counted while it had taken over."""
        self.completed += inner.completed
        self._seen.update(inner._seen)
        self.any_stepped = bool(self._seen)
        self._members |= inner._members
        self._occasional = (self._occasional | inner._occasional) - self._members

    def _close(self) -> None:
        if self._round:  # the members that did not step are occasional from now on
            self._occasional |= self._members - self._round
            self._members = set(self._round)
        self._round = set()
        self.completed += 1

