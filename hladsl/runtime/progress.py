"""Progress lines for slow compiles and tuning runs.

Triton compiles a kernel lazily, at the first launch of each (kernel, constexpr
arguments, warps, stages) variant; hladsl's backward of a large spec launches a
dozen variants that take seconds each. ``first_launch`` times the first launch of
every variant: if it takes longer than ``SLOW_S`` seconds, one line goes to stderr
while it runs ("hladsl: compiling hla2_bwd.grad_kernel [3/19]..."); fast compiles
stay quiet. The numbering counts the variants a call compiles: ``counted`` finds
how many there are by a dry run of the call first (launches recorded, not made).

``HLADSL_QUIET=1`` silences every line; under the Triton interpreter (CPU) there is
nothing to compile, and a first launch is the kernel running, so nothing is printed.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading

from hladsl.runtime.direct import LAUNCH_OPTIONS

SLOW_S = 2.0   # a compile or tuning run longer than this gets a line

_SEEN: set = set()     # variants launched in this process (compiled, or cached on disk)
_PLANNED: set = set()  # calls whose variants were counted by a dry run
_call = contextvars.ContextVar("hladsl_progress_call", default=None)
_dry = contextvars.ContextVar("hladsl_progress_dry", default=None)
_hushed = contextvars.ContextVar("hladsl_progress_hushed", default=False)


def quiet() -> bool:
    return (os.environ.get("HLADSL_QUIET", "") not in ("", "0")
            or os.environ.get("TRITON_INTERPRET") == "1")


def module_label(module: str) -> str:
    """'hla2_bwd' for the generated module hladsl_generated_hla2_bwd_<key>."""
    return module.removeprefix("hladsl_generated_").rpartition("_")[0] or module


def kernel_label(kernel) -> str:
    """'hla2_bwd.grad_kernel' for a kernel of the generated module hladsl_generated_hla2_bwd_<key>."""
    fn = getattr(kernel, "fn", kernel)
    return f"{module_label(getattr(fn, '__module__', '') or '')}." \
           f"{getattr(fn, '__name__', type(kernel).__name__)}"


_CONSTEXPRS: dict = {}   # id(kernel) -> (kernel, its constexpr names): asked at every launch


def constexpr_names(kernel) -> tuple[str, ...] | None:
    """The kernel's tl.constexpr parameters (None when it does not say: a fake kernel)."""
    hit = _CONSTEXPRS.get(id(kernel))
    if hit is not None and hit[0] is kernel:
        return hit[1]
    params = getattr(kernel, "params", None)
    names = None if params is None else tuple(
        p.name for p in params if getattr(p, "is_constexpr", False))
    _CONSTEXPRS[id(kernel)] = (kernel, names)
    return names


_OPTION_ORDER = tuple(sorted(LAUNCH_OPTIONS))


def variant(kernel, args: dict) -> tuple:
    """What Triton compiles one binary per: the kernel, its constexpr arguments and
    launch options (``direct.LAUNCH_OPTIONS``: warps, stages, a register cap, ...; every
    non-tensor argument where the kernel does not list its constexprs)."""
    names = constexpr_names(kernel)
    if names is None:
        names = tuple(sorted(k for k, v in args.items() if not hasattr(v, "data_ptr")))
    picked = tuple((n, str(args[n])) for n in names if n in args)
    return (kernel_label(kernel), id(kernel), picked,
            tuple((k, args[k]) for k in _OPTION_ORDER if k in args))


def dry_run() -> bool:
    """Inside ``counted``'s dry run: launches are recorded, not made."""
    return _dry.get() is not None


def record(kernel, args: dict) -> None:
    found = _dry.get()
    key = variant(kernel, args)
    if key not in _SEEN and key not in found:
        found.append(key)


class _Call:
    def __init__(self, total: int | None):
        self.total, self.done = total, 0


@contextlib.contextmanager
def slow_line(text: str, delay: float | None = None):
    """Print ``text`` on stderr if the block is still running after ``delay``
    (default SLOW_S) seconds; nothing if it finishes sooner or output is quiet."""
    if quiet():
        yield
        return
    timer = threading.Timer(SLOW_S if delay is None else delay,
                            lambda: print(text, file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@contextlib.contextmanager
def hushed():
    """No compile lines inside (a tuning run prints its own line)."""
    token = _hushed.set(True)
    try:
        yield
    finally:
        _hushed.reset(token)


def numbering() -> str:
    """' [n/m]': this variant's place among the ones the current call compiles."""
    call = _call.get()
    if call is None:
        return ""
    call.done += 1
    if call.total is None:
        return f" [{call.done}]"
    return f" [{call.done}/{max(call.total, call.done)}]"


def first_launch(kernel, args: dict, launch) -> None:
    """``launch()``; the first launch of a variant timed for a progress line."""
    if quiet():
        launch()
        return
    key = variant(kernel, args)
    if key in _SEEN:
        launch()
        return
    if _hushed.get():   # a tuning run's candidate: the tuning line covers it
        launch()
    else:
        with slow_line(f"hladsl: compiling {kernel_label(kernel)}{numbering()}..."):
            launch()
    _SEEN.add(key)


def counted(key, run):
    """``run()`` numbering its compiles n of m. The first time ``key`` (a call's
    shape class) runs, a dry run of ``run`` counts the variants it will launch that
    this process has not launched yet; none -> no second pass is needed."""
    if quiet() or _dry.get() is not None or _call.get() is not None:
        return run()
    total = None
    if key not in _PLANNED:
        _PLANNED.add(key)
        found: list = []
        token = _dry.set(found)
        try:
            run()
            total = len(found)
        except Exception:   # noqa: BLE001 -- only a count: the real run reports any error
            total = None
        finally:
            _dry.reset(token)
        if total == 0:
            return run()
    token = _call.set(_Call(total))
    try:
        return run()
    finally:
        _call.reset(token)


def tuning_line(kernel, candidates: int) -> str:
    return f"hladsl: tuning {kernel_label(kernel)}{numbering()} ({candidates} candidates)..."

