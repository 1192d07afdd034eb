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

A step a GradScaler skips is not an optimizer step, as before.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

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

    def stepped(self, opt: torch.optim.Optimizer) -> int:
        """Count a step of ``opt``; the index of the iteration it belongs to."""
        key = id(opt)
        first = key not in self._seen
        self._seen[key] = opt
        self.any_stepped = True
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
            if late:
                return self.completed - 1  # its step belongs to the iteration just closed
        if key in self._occasional:  # (none, most loops: one test of an empty set)
            if key not in self._aside:
                self._aside.add(key)  # in the iteration it comes in: after the members', the one just closed
                return self.completed - 1 if self.completed and not self._round else self.completed
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
