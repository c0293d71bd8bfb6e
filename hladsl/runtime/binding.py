"""Bound calls: a forward call -- or an autograd call's forward and its backward
(``Op.forward_keeping``, ``Op.backward_impl``: ``op._training_key``) -- replayed as its
launches, with no per-call Python but the tensors'.

A call's launch plan depends on its tensors' shapes, strides, dtypes and alignment and
on the op's settings only (``op._call_signature`` keys them), so a call like an earlier
one in all but its data can skip the validation, the
torch preparation, the plan lookups and Triton's argument binding: ``Op.__call__``
records the first such call (``recording``), and where every tensor the kernels got
has a known role it keeps a ``BoundCall`` that launches the same compiled variants
(``direct.Bound``) on the new call's tensors. A tensor's role is one of:

* ``arg``: a tensor the caller passed (matched by address: the kernels read a
  token tile as a strided view of the caller's tensor, starting where it starts); a
  backward's are the tokens, g, dO and what its forward kept;
* ``derived``: a tensor the call computes from its arguments, registered under the
  name of the function that computes it (the in-chunk cumulative log gates, a grouped
  scan's group decays);
* ``fresh``: a buffer the call allocated for the kernels to write before any kernel
  reads it (outputs, final states, chunk starts, deltas, d-states, gradient tiles),
  allocated again per call from its recorded layout, uninitialised: a buffer a kernel
  accumulates into from zero, or one a torch op changes between launches, must not be;
* ``kept``: a table that outlives calls (packed-index tables), kept as is.

Any other tensor -- a copy made by a torch op (padding, a cast, a contiguous copy
of a strided input) -- leaves the call unbound: it validates every time, as it
would without this module. So does a tuned launch or one the direct path cannot bind
(the interpreter); a recording spoiled by a launch that raised is tried again on a
later call (``op.RECORD_TRIES``).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

from hladsl.runtime import direct, progress


class Recording:
    """What one validated call launched, and the roles its tensors may take."""

    def __init__(self, args: list):
        self.args = {x.data_ptr(): n for n, x in enumerate(args) if _addressable(x)}
        self.launches: list[tuple] = []        # (kernel, grid, arguments)
        self.fresh: dict[int, torch.Tensor] = {}   # address -> buffer
        self.derived: dict[int, tuple[str, torch.Tensor]] = {}   # address -> (name, tensor)
        # two arguments at one address: which one a kernel read is ambiguous, and a later
        # call may pass two tensors there
        self.bindable = len(self.args) == sum(map(_addressable, args))
        self.raised = False    # a launch raised (and was retried): the next call may bind
        self.returned = None   # what the kernels returned, with the call's preparation: ``returned``

    def role(self, x: torch.Tensor):
        if not _addressable(x):
            return None
        ptr = x.data_ptr()
        if ptr in self.args:
            return ("arg", self.args[ptr])
        if ptr in self.derived:
            return ("derived", self.derived[ptr][0])
        if ptr in self.fresh:
            return ("fresh", ptr)
        if _KEPT.get(ptr) is x:
            return ("kept", x)
        return None


_LOCAL = threading.local()            # .stack: this thread's recordings, innermost last
_KEPT: dict[int, torch.Tensor] = {}   # address -> a table kept for the process (``kept``)


def _current() -> Recording | None:
    """The recording this thread's launches go to; none inside ``progress.counted``'s dry run,
    whose buffers are dropped when it returns (holding them would double a first call's memory)."""
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack and not progress.dry_run() else None


def _addressable(x) -> bool:
    return isinstance(x, torch.Tensor) and x.numel() > 0


@contextlib.contextmanager
def recording(args: list):
    """Record the launches of the call inside the block; ``args``: the caller's tensors."""
    rec = Recording(args)
    stack = _LOCAL.__dict__.setdefault("stack", [])
    stack.append(rec)
    try:
        yield rec
    finally:
        stack.remove(rec)


def active() -> bool:
    return _current() is not None


def fresh(x: torch.Tensor) -> torch.Tensor:
    """``x`` is a buffer this call allocated (its contents are written before read)."""
    rec = _current()
    if rec is not None:
        rec.fresh[x.data_ptr()] = x
    return x


def kept(x: torch.Tensor) -> torch.Tensor:
    """``x`` is a table the process keeps unchanged (made once, whether or not a call
    is being recorded: a later recording finds it here)."""
    _KEPT[x.data_ptr()] = x
    return x


def derived(name: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` is computed from the call's arguments by the bound call's ``derive[name]``."""
    rec = _current()
    if rec is not None:
        rec.derived[x.data_ptr()] = (name, x)
    return x


def launched(kernel, grid, args: dict) -> None:
    """A launch of ``kernel`` that went through (``args`` as ``direct`` keyed it)."""
    rec = _current()
    if rec is not None:
        rec.launches.append((kernel, tuple(grid), args))


def returned(*what) -> None:
    """What the recorded call's kernels returned, before the torch finish (a forward: its
    o tiles, final states and preparation; a backward: its gradient tiles, dΛ and preparation)."""
    rec = _current()
    if rec is not None:
        rec.returned = what


def unbindable(raised: bool = False) -> None:
    """This call launched something a bound call could not repeat: a tuned launch, or one
    that ``raised`` (the launch layer then remembers what fits, so a later call may bind)."""
    rec = _current()
    if rec is not None:
        rec.bindable = False
        rec.raised |= raised


class BoundCall:
    """The launches of a recorded call, each a ``direct.Bound`` with its tensors' roles;
    ``run(args, derive, keep)`` computes the derived tensors and launches, allocating each
    fresh buffer just before its first launch and dropping it after its last unless the
    caller ``keep``s it (its outputs), as the validated call frees its temporaries: a
    replay's peak memory is no higher. Returns {address recorded: buffer} of the kept ones
    for the caller to pick its outputs from."""

    def __init__(self, launches: list, fresh: dict[int, tuple]):
        self.launches = launches    # (direct.Bound, [role per tensor slot])
        self.fresh = fresh          # address recorded -> (shape, stride, dtype, device)
        first, last = {}, {}
        for n, (_, roles) in enumerate(launches):
            for kind, key in roles:
                if kind == "fresh":
                    first.setdefault(key, n)
                    last[key] = n
        self.derived = {key for _, roles in launches for kind, key in roles if kind == "derived"}
        self.born = [[p for p, n in first.items() if n == i] for i in range(len(launches))]
        self.dying = [[p for p, n in last.items() if n == i] for i in range(len(launches))]

    def run(self, args: list, derive: dict[str, Callable[[], torch.Tensor]],
            keep: set) -> dict[int, torch.Tensor]:
        buffers = {}
        made = {name: fn() for name, fn in derive.items()}
        for (bound, roles), born, dying in zip(self.launches, self.born, self.dying):
            for ptr in born:
                shape, stride, dtype, device = self.fresh[ptr]
                buffers[ptr] = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            bound.launch([args[key] if kind == "arg" else made[key] if kind == "derived"
                          else buffers[key] if kind == "fresh" else key for kind, key in roles])
            for ptr in dying:   # stream-ordered: the allocator reuses it after this launch
                if ptr not in keep:
                    del buffers[ptr]
        return buffers


def bind(rec: Recording) -> BoundCall | None:
    """The bound form of a recorded call, or None where some launch or tensor has no
    role a bound call could fill."""
    if not rec.bindable or not rec.launches:
        return None
    launches, used = [], set()
    for kernel, grid, args in rec.launches:
        names = [n for n, v in args.items() if isinstance(v, torch.Tensor)]
        roles = [rec.role(args[n]) for n in names]
        if any(r is None for r in roles):
            return None
        bound = direct.bind(kernel, grid, args, names)
        if bound is None:
            return None
        used.update(key for kind, key in roles if kind == "fresh")
        launches.append((bound, roles))
    fresh = {ptr: (tuple(x.shape), x.stride(), x.dtype, x.device) for ptr, x in rec.fresh.items()
             if ptr in used}
    return BoundCall(launches, fresh)
