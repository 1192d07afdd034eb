"""Many processes: every rank stops at one rank's event, and names the rank that found it.

docs/how-it-watches.md ("Many processes") says why and where the ranks agree. What gloo does to a rank that
raises alone (torch 2.13, CPU, ``tests/test_distributed.py``): if the failing rank exits, its peers get
"Connection closed by peer" within about two seconds; if it stays alive (``try/except``, a notebook), they wait in
DDP's all-reduce until the process-group timeout, and ``ProcessGroup.abort()`` closes no connection on gloo; a
one-element all-reduce issued while the others are in DDP's bucket all-reduce aborts the process
(``gloo::EnforceNotMet``). So an agreement collective is issued only where every rank is, with no DDP collective
pending:

* **The optimizer step's pre-hook** (of an optimizer that steps a watched DDP or FSDP model; a probe one rank
  steps for itself issues none), and a GradScaler's skipped ``scaler.step`` in its place (every rank skips the
  same step: ``found_inf`` is the same on all). Under a process group the checks are deferred and judged there.
  Each rank takes part in one all-reduce (MAX) of an integer that encodes which rank found the most telling event
  (:meth:`Agreement.settle`); that rank puts its pickled report in the store so the others can name it.
* **The watch's exit**, through the store (a bounded wait, not a hang): each rank posts what it found and waits
  for the others' posts (:meth:`Agreement.leave`); a rank leaving by an exception counts itself in without
  waiting (:meth:`Agreement.left_by`). Only a watch of a DDP or FSDP model does this (lockstep.py).

An event judged between agreement points of a lockstep watch is **held** (:meth:`Agreement.hold`): the rank checks
nothing more and raises with the others at the next point; the step that would apply it is not taken. A rank that
must raise alone posts its report on the store's **stop channel** (:meth:`Agreement.post`), read by an inference
watch after each step, by a rank whose collective failed or timed out, and by a rank waiting at the exit.

Not covered: a failing rank that stays alive after an exception broke its step before the next agreement point
(its peers wait until the process group's timeout, as without a watch; when it exits they name its event); a
failing rank 0 that serves the store itself (``init_method="tcp://"``, not ``torchrun``) and exits. Every rank must
enter the watch.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import pickle
import struct
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nan_magic.distributed.ranks import process_group
from nan_magic.errors.exceptions import NonFiniteError, PeerNonFiniteError
from nan_magic.plain import to_pairs
from nan_magic.records import Note, Phase, Report

__all__ = ["EXIT_WAIT_S", "Agreement", "Finding"]


class Finding(Protocol):
    """What agreement reads of the engine's finding (hot/kept/finding.py): a phase, and the module call, if any."""

    @property
    def phase(self) -> Phase: ...

    @property
    def call(self) -> object | None: ...


#: How telling a rank's event is: a producer on that rank beats a non-finite
#: parameter gradient seen at the step, which may have arrived through DDP's all-reduce.
_PRODUCED, _ARRIVED = 2, 1
#: A flag as the exit round's store key holds it: one signed 8-byte integer, little-endian.
_FLAG = struct.Struct("<q")

_EVENT_KEY = "nan_magic/event/{round}/{rank}"
_STOPS = "nan_magic/stops"
_EXIT_PREFIX = "nan_magic/exit/{number}"
_STOP_KEY = "nan_magic/stop/{count}"

#: How long a rank waits at the watch's exit for the others to reach theirs.
EXIT_WAIT_S = 30.0
# How long a waiting rank waits before it looks at the stop channel again.
_POLL_S = 0.25

# torch's record of the default process group (``_world._default_pg``, which ``dist.is_initialized()`` reads
# through two properties): Agreement.several keys its kept answer on it. None where torch has no distributed
# package, or keeps it elsewhere (then several asks process_group() each time).
_WORLD: Any = None
try:
    from torch.distributed.distributed_c10d import _world

    _world._default_pg  # noqa: B018 (present: the key is readable)
    _WORLD = _world
except (ImportError, AttributeError):
    pass
_UNASKED = object()

# Exit rounds taken by this process. Every rank leaves its lockstep watches in the
# same order, so this count names the same round on every rank (store keys).
_EXIT_ROUNDS = itertools.count()


class Agreement:
    """One watch's part in stopping every rank together (see the module docstring).

    :meth:`open` marks the optimizer step's pre-hook (the agreement point);
    :meth:`settle` takes part in its one collective, once. :meth:`hold`
    keeps an event judged elsewhere for the next point; :meth:`leave` and
    :meth:`left_by` settle at the watch's exit; :meth:`post` and
    :meth:`peer_stop` are the stop channel.
    """

    def __init__(self, *, alone: bool = False) -> None:
        # A replay's watch (localize/replay/tiered/step.py) runs on one rank alone, inside the watch that agrees.
        self._alone = alone
        # `several`'s last answer, and the default process group it was given for (_UNASKED: none yet).
        self._group: Any = _UNASKED
        self._several = False
        self._open = False
        # Every rank takes part in the same collectives in the same order, so
        # this count names the same round on every rank (store keys).
        self._round = 0
        self._held: tuple[NonFiniteError, Finding | None] | None = None
        # The stop channel's count when the watch began: only later posts are this run's. Without a
        # process group yet (the watched script starts it: ``python -m nan_magic run``), every post is.
        self._stops_seen = 0
        if self.several:
            self._stops_seen = _store_count(_STOPS)

    @staticmethod
    def _rank_world() -> tuple[int, int]:
        return process_group() or (0, 1)

    def _take_held(self) -> tuple[NonFiniteError | None, Finding | None]:
        """The event held for the next agreement point (or none), no longer held."""
        held, self._held = self._held, None
        return held or (None, None)

    @property
    def several(self) -> bool:
        """Whether this watch runs as one rank of several (asked each time: the process group may start late).

        Asked at every optimizer step: the answer is kept while torch's default process group is the same object
        (an attribute read, no call; ``process_group()`` is seven Python calls), and asked again when one is
        created or destroyed. The group is held as the key: an ``is`` test on a live object, never a reused id.
        """
        if self._alone:
            return False
        if _WORLD is None:  # (a torch that keeps its default group elsewhere: asked each time)
            group = process_group()
            return group is not None and group[1] > 1
        if (default := _WORLD._default_pg) is not self._group:
            self._group = default
            group = process_group()
            self._several = group is not None and group[1] > 1
        return self._several

    @property
    def holding(self) -> bool:
        """Whether an event waits for the next agreement point (no later event counts)."""
        return self._held is not None

    def open(self) -> None:
        self._open = self.several

    def close(self) -> None:
        self._open = False

    def hold(self, own: NonFiniteError, finding: Finding | None, lockstep: Callable[[], bool]) -> bool:
        """Keep ``own`` for the next agreement point instead of raising it now; True when kept.

        Only between points of a watch in ``lockstep()`` (every rank steps
        together, so every rank reaches the next point; asked only under a
        process group): elsewhere the rank raises at once and posts its
        report (:meth:`post`).
        """
        if self._open or not self.several or not lockstep():
            return False
        if self._held is None:
            self._held = (own, finding)
        return True

    def settle(self, own: NonFiniteError | None, finding: Finding | None = None) -> NonFiniteError | None:
        """The error this rank raises: its own (or the one it held), a peer's (:class:`PeerNonFiniteError`), or None.

        Outside the agreement point (or outside a process group) ``own`` is
        returned unchanged, and posted (:meth:`post`): a collective issued
        where a peer may be inside DDP's all-reduce would abort both processes.
        """
        if not self._open:
            if own is not None:
                self.post(own)  # this rank raises alone: the others learn of it through the stop channel
            return own
        self._open = False
        if self._held is not None:
            own, finding = self._take_held()
        rank, world = self._rank_world()
        round_, self._round = self._round, self._round + 1
        store = _store()
        flag = 0
        if own is not None:
            # Put the report where the others can read it before they learn there is one to read.
            store.set(_EVENT_KEY.format(round=round_, rank=rank), pickle.dumps(own.report))
            flag = _flag(finding, rank, world)
        agreed = torch.tensor([flag], dtype=torch.int64, device=_flag_device())
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        value = int(agreed.item())
        if value == 0:
            return None
        first = _rank_of(value, world)
        error = own
        if first != rank:
            report: Report = pickle.loads(store.get(_EVENT_KEY.format(round=round_, rank=first)))
            error = _peer_error(report, own, rank)
        # Only when stopping: wait until every rank has read the report, so that the rank
        # that serves the store (rank 0 under torchrun) does not exit before the others have it.
        dist.all_reduce(torch.zeros(1, dtype=torch.int64, device=agreed.device))
        return error

    def leave(self, together: bool) -> NonFiniteError | None:
        """The error this rank raises as its watch is left normally: held, agreed at the exit, or posted by a peer.

        Where every rank leaves ``together`` (a DDP or FSDP model is watched:
        lockstep.py), the exit is a round through the store
        (:meth:`_exit_round`); elsewhere it reads the stop channel.
        """
        own, finding = self._take_held()
        if not self.several:
            return own
        if together:
            return self._exit_round(own, finding)
        return own or self.peer_stop()

    def left_by(self, exception: BaseException, together: bool) -> NonFiniteError | None:
        """What this rank raises, ``from exception``, as an exception leaves its watch; None: the exception itself.

        Where every rank leaves ``together``, this rank counts itself in at the exit's round without
        waiting (the others, at their exit, must neither wait for it nor
        lose count of the rounds). A held event is this rank's cause (a
        value it held went on to break an op): it is posted, since this
        rank now stops alone. Otherwise an exception other than our own may
        be a collective failing because another rank stopped (gloo's
        "Connection closed by peer", a timeout): its posted error names it.
        """
        own, finding = self._take_held()
        if not self.several:
            return own
        if together:
            self._depart(own, finding)
        if own is not None:
            self.post(own)
            return own
        return None if isinstance(exception, NonFiniteError) else self.peer_stop()

    def post(self, own: NonFiniteError) -> None:
        """Put ``own``'s report in the stop channel: this rank raises without the others meeting it.

        Fail-soft: a store that went (the rank serving it exited) costs the
        others the name, never this rank its own report.
        """
        if not self.several:
            return
        try:
            store = _store()
            count = store.add(_STOPS, 1)
            store.set(_STOP_KEY.format(count=count), pickle.dumps(own.report))
        except RuntimeError:
            return
        self._stops_seen = count

    def peer_stop(self) -> PeerNonFiniteError | None:
        """Another rank's error posted in the stop channel since this watch began, or None (one store round trip)."""
        if not self.several:
            return None
        try:
            store = _store()
            count = store.add(_STOPS, 0)
            if count <= self._stops_seen:
                return None
            report: Report = pickle.loads(store.get(_STOP_KEY.format(count=self._stops_seen + 1)))
        except RuntimeError:  # the store went with the rank that served it: nothing to name
            return None
        self._stops_seen = count
        return _peer_error(report, None, self._rank_world()[0])

    def _stop_posted(self) -> bool:
        return _store_count(_STOPS) > self._stops_seen

    def _exit_round(self, own: NonFiniteError | None, finding: Finding | None) -> NonFiniteError | None:
        """Every rank's exit posts what it holds; the most telling event is raised on every rank.

        Through the store, with a bounded wait: a rank that stopped elsewhere
        costs the others :data:`EXIT_WAIT_S` at most, not a hang, and no
        wait at all when it left its watch by an exception (it counts itself
        in, :meth:`_depart`) or posted its event in the stop channel. A rank
        with an event appends its flag to one key; a second arrival, only
        then, keeps the rank that serves the store (rank 0 without torchrun)
        alive until every rank has read the report.
        """
        number = next(_EXIT_ROUNDS)
        rank, world = self._rank_world()
        try:
            store, prefix = self._enter_round(number, own, finding)
            if not _arrive(store, f"{prefix}/arrived", world, self._stop_posted, number):
                # A rank did not come: it stopped elsewhere, and may have posted why.
                return own or self.peer_stop()
            if not store.check([f"{prefix}/flags"]):
                return own or self.peer_stop()
            first = _rank_of(max(_flags(store, prefix)), world)
            error = own
            if first != rank:
                error = _peer_error(pickle.loads(store.get(f"{prefix}/report/{first}")), own, rank)
            _arrive(store, f"{prefix}/read", world)
            return error
        except RuntimeError:  # the store went with the rank that served it
            return own

    def _enter_round(self, number: int, own: NonFiniteError | None, finding: Finding | None) -> tuple[Any, str]:
        """The store and exit round ``number``'s key prefix, with this rank's event posted in it (if any)."""
        rank, world = self._rank_world()
        store = _store()
        prefix = _EXIT_PREFIX.format(number=number)
        if own is not None:
            store.set(f"{prefix}/report/{rank}", pickle.dumps(own.report))
            # One 8-byte integer per rank with an event, appended: read once every rank came.
            store.append(f"{prefix}/flags", _FLAG.pack(_flag(finding, rank, world)))
        return store, prefix

    def _depart(self, own: NonFiniteError | None, finding: Finding | None) -> None:
        """Take this rank's part in the exit's round without waiting: it is leaving by an exception."""
        number = next(_EXIT_ROUNDS)
        world = self._rank_world()[1]
        try:
            store, prefix = self._enter_round(number, own, finding)
            _count_in(store, f"{prefix}/arrived", world, number)
            _count_in(store, f"{prefix}/read", world)  # it reads nothing: counted in at both
        except RuntimeError:
            return


def _count_in(store: Any, key: str, world: int, number: int | None = None) -> bool:
    """Count this rank in at ``key``; True when it is the last of ``world``, which then says so at ``key/all``.

    The last to come to exit round ``number`` also clears the round before it from the store.
    """
    if store.add(key, 1) < world:
        return False
    store.set(f"{key}/all", b"1")
    if number is not None:
        _forget_round(store, number - 1, world)
    return True


def _arrive(
    store: Any, key: str, world: int, stopped: Callable[[], bool] = lambda: False, number: int | None = None
) -> bool:
    """Count this rank in at ``key`` and wait for all ``world``; True when all came.

    The last to come sets ``key/all``, which the others wait on; the wait
    ends early, False, after :data:`EXIT_WAIT_S` or as soon as ``stopped()``
    (a rank posted in the stop channel: it will not come). The last to come
    to round ``number`` also clears the round before it from the store.
    """
    if _count_in(store, key, world, number):
        return True
    deadline = time.monotonic() + EXIT_WAIT_S
    while True:
        try:
            store.wait([f"{key}/all"], datetime.timedelta(seconds=_POLL_S))
            return True
        except dist.DistStoreError:  # this slice timed out
            if time.monotonic() > deadline or stopped():
                return False


def _forget_round(store: Any, number: int, world: int) -> None:
    """Delete exit round ``number``'s keys: every rank has come to the next round, so none reads them again.

    (A watch entered once per step, as a decorator, would otherwise leave a
    few keys in the store at every step.)
    """
    if number < 0:
        return
    prefix = _EXIT_PREFIX.format(number=number)
    try:
        if store.check([f"{prefix}/flags"]):
            for flag in _flags(store, prefix):
                store.delete_key(f"{prefix}/report/{_rank_of(flag, world)}")
        for key in ("arrived", "arrived/all", "read", "read/all", "flags"):
            store.delete_key(f"{prefix}/{key}")
    except RuntimeError:  # a store that went takes its keys with it
        return


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _store_count(key: str) -> int:
    """A counter in the store (0 when the store cannot be reached: nothing to learn from it)."""
    try:
        return int(_store().add(key, 0))
    except RuntimeError:
        return 0


def _flag(finding: Finding | None, rank: int, world: int) -> int:
    """The one integer a rank's event is reduced as: how telling it is, then the lowest rank first."""
    arrived = finding is not None and finding.call is None and finding.phase == Phase.BACKWARD
    return (_ARRIVED if arrived else _PRODUCED) * world + (world - 1 - rank)


def _flags(store: Any, prefix: str) -> list[int]:
    """The flags the ranks with an event appended in an exit round, as the integers they packed."""
    return [flag for (flag,) in _FLAG.iter_unpack(store.get(f"{prefix}/flags"))]


def _rank_of(flag: int, world: int) -> int:
    """The rank whose event :func:`_flag` reduced to ``flag``."""
    return world - 1 - flag % world


def _flag_device() -> torch.device:
    """Where the flag must live for the default group's backend: NCCL alone reduces only CUDA tensors."""
    backend = str(dist.get_backend())
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _peer_error(report: Report, own: NonFiniteError | None, rank: int) -> PeerNonFiniteError:
    return PeerNonFiniteError(_as_seen_here(report, own, rank), local_report=own.report if own else None)


def _as_seen_here(report: Report, own: NonFiniteError | None, rank: int) -> Report:
    """The producing rank's report, with a note of how the event reached this rank."""
    if own is not None and own.report.phase == Phase.BACKWARD:
        note = Note.of("rank-reduced", rank=rank, tensor=to_pairs(own.report.tensor))
    elif own is not None:
        seen = own.report
        note = Note.of("rank-also-saw", rank=rank, nan=seen.nan, posinf=seen.posinf, neginf=seen.neginf,
                       tensor=to_pairs(seen.tensor), where=seen.where, phase=str(seen.phase), op=seen.op)
    else:
        note = Note.of("rank-saw-none", rank=rank)
    return dataclasses.replace(report, note_facts=(*report.note_facts, note))
