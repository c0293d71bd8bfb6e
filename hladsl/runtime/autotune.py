"""Optional autotuning of kernel launches (``op.autotune = True`` or ``HLADSL_AUTOTUNE=1``).

The mechanism only: which candidates are tried is a rule of ``runtime.launch``.
While an op call runs with tuning on (a ``session``, CUDA only: never on CPU or
under the Triton interpreter), the first launch of each kernel in a shape class
times every candidate launch config with ``triton.testing.do_bench`` and keeps the
fastest one that runs (a candidate raising OutOfResources, or ``Unavailable``, is
skipped). Candidates run on scratch copies of the kernel's tensors
(``scratch_copies``), so a kernel that writes in place or accumulates never
touches the caller's buffers while it is timed; the winner then runs once on the
real ones. Runners decorated with ``tunes_schedule`` time their "fused", "two_pass"
and "scan" schedules (and "staged") the same way when asked for "auto".

Winners are kept in ``<cache dir>/autotune.json`` (``$HLADSL_CACHE_DIR``, default
``~/.cache/hladsl``), keyed by the GPU's name, the generated module (its name holds
the hash of the program, template and versions) and kernel, the launch's constexpr
arguments, and the shape class: dims, dtype, gated, B*H and T rounded up to powers
of two. A later process finds them there and launches tuned without timing.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hladsl.runtime import progress

FILE_NAME = "autotune.json"


class Unavailable(ValueError):
    """A launch option this program cannot use (e.g. a fused schedule without a
    fused kernel): the tuner skips the candidate."""


def requested(flag: bool) -> bool:
    return bool(flag) or os.environ.get("HLADSL_AUTOTUNE", "") not in ("", "0")


def available(device) -> bool:
    """Timing needs a real GPU: not on CPU, not under the interpreter, not while a
    CUDA graph is captured (do_bench synchronises)."""
    return (torch.device(device).type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and not torch.cuda.is_current_stream_capturing())


def bucket(n: int) -> int:
    """n rounded up to a power of two: the sizes one tuned config serves."""
    return 1 << max(int(n) - 1, 0).bit_length()


def gpu_name(device) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _key_text(key: dict) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"), default=str)


def _do_bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=25)


def _skippable() -> tuple:
    from triton.runtime.errors import OutOfResources
    return (OutOfResources, Unavailable)


class Tuner:
    """Winners by key, read from and written to one JSON file. ``timer(fn)`` returns
    a time for ``fn``'s run (default: triton.testing.do_bench, ms)."""

    def __init__(self, path: Path, timer: Callable | None = None):
        self.path = Path(path)
        self.timer = timer or _do_bench
        self._table: dict | None = None
        self._fast: dict = {}   # a caller's cheap hashable key -> winner (no JSON per launch)

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        entries = data.get("entries") if isinstance(data, dict) else None
        return entries if isinstance(entries, dict) else {}

    def lookup(self, key: dict, fast=None) -> dict | None:
        """The stored winner for ``key`` (None: not tuned yet); ``fast``, a hashable
        the caller builds cheaply for the same launch, skips the key's JSON next time."""
        if fast is not None and fast in self._fast:
            return self._fast[fast]
        if self._table is None:
            self._table = self._read()
        winner = self._table.get(_key_text(key))
        if winner is not None and fast is not None:
            self._fast[fast] = winner
        return winner

    def tune(self, key: dict, candidates: list[dict], run: Callable[[dict], object],
             line: str = "") -> dict:
        """The fastest of ``candidates`` that runs (``run(candidate)`` once, then timed),
        remembered under ``key`` here and on disk. Raises the last skip error when
        none runs."""
        best, best_time, error = None, math.inf, None
        with progress.slow_line(line), progress.hushed():
            for candidate in candidates:
                try:
                    run(candidate)   # compiles; a candidate that cannot run fails here
                    elapsed = self.measure(candidate, lambda c=candidate: run(c))
                except _skippable() as exc:
                    error = exc
                    continue
                if elapsed < best_time:
                    best, best_time = candidate, elapsed
        if best is None:
            raise error if error is not None else ValueError("no candidate launch config to time")
        self.lookup(key)
        self._table[_key_text(key)] = best
        self._save(key, best)
        return best

    def measure(self, candidate: dict, fn: Callable) -> float:
        """The time of ``fn`` (running ``candidate``)."""
        return self.timer(fn)

    def _save(self, key: dict, winner: dict) -> None:
        """Merge into the file as it is now (another process may have added entries)."""
        from hladsl.codegen.cache import _write_atomic
        entries = self._read()
        entries[_key_text(key)] = winner
        text = json.dumps({"version": 1, "entries": entries}, indent=1, sort_keys=True)
        try:
            _write_atomic(self.path, text + "\n")
        except OSError:
            pass   # a read-only cache: the winner still serves this process


_TUNERS: dict[str, Tuner] = {}


def tuner_for(path: Path) -> Tuner:
    if str(path) not in _TUNERS:
        _TUNERS[str(path)] = Tuner(path)
    return _TUNERS[str(path)]


@dataclass(frozen=True)
class Session:
    tuner: Tuner
    shape: dict        # the shape class every key of this call carries
    shape_text: str    # the same, hashable (for the tuner's fast keys)


_session: contextvars.ContextVar = contextvars.ContextVar("hladsl_autotune", default=None)


def current() -> Session | None:
    """The tuning session of the running call, None when tuning is off (and during a
    dry run, which launches nothing)."""
    return None if progress.dry_run() else _session.get()


def shape_class(first: torch.Tensor, dims: dict, gated: bool, n_seq: int) -> dict:
    """first: a token input [B, T, H, dim] (B = 1 and T the total for varlen, n_seq
    sequences)."""
    B, T, H = first.shape[:3]
    return {"gpu": gpu_name(first.device), "dims": sorted(dims.items()), "dtype": str(first.dtype),
            "gated": bool(gated), "bh": bucket(n_seq * H), "t": bucket(B * T // max(n_seq, 1))}


@contextlib.contextmanager
def session(flag: bool, first: torch.Tensor, dims: dict, gated: bool, cu_seqlens=None,
            tuner: Tuner | None = None):
    """Tuning for the launches of one op call when ``flag`` or HLADSL_AUTOTUNE asks
    for it and the tensors are on a GPU; otherwise nothing changes."""
    if not (requested(flag) and available(first.device)):
        yield None
        return
    from hladsl.codegen.cache import cache_dir
    n_seq = first.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    with tuning(tuner or tuner_for(cache_dir() / FILE_NAME), shape_class(first, dims, gated, n_seq)) as s:
        yield s


@contextlib.contextmanager
def tuning(tuner: Tuner, shape: dict):
    """Launches inside tune with ``tuner`` for the shape class ``shape``, whatever the
    device (``session`` decides when; the tests use this on CPU with a fake timer)."""
    token = _session.set(Session(tuner, shape, _key_text(shape)))
    try:
        yield _session.get()
    finally:
        _session.reset(token)


def kernel_source(kernel) -> str:
    """The generated module and kernel name: the module's name holds the hash of
    the program, template and versions its source was rendered from."""
    fn = getattr(kernel, "fn", kernel)
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__name__', type(kernel).__name__)}"


def scratch_copies(args: dict) -> dict:
    """Copies of the tensor arguments on fresh memory: one copy of each storage they
    view, the views rebuilt on it (same offsets and strides, aliasing kept)."""
    copies, out = {}, {}
    for name, x in args.items():
        if not isinstance(x, torch.Tensor):
            continue
        storage = x.untyped_storage()
        key = (storage.data_ptr(), x.device)
        if key not in copies:
            copies[key] = storage.clone()
        out[name] = x.new_empty(0).set_(copies[key], x.storage_offset(), x.size(), x.stride())
    return out


def tunes_schedule(source: Callable[[dict], str], schedules=("fused", "two_pass", "scan")):
    """Decorates a runner with a ``schedule`` argument: under a tuning session
    "auto" becomes the fastest of ``schedules`` (the forward and backward add "staged") for the shape class
    (``source(arguments)`` names the generated module, for the key). The runner
    allocates its outputs, so the trial runs leave the caller's tensors alone."""
    def wrap(runner):
        signature = inspect.signature(runner)

        @functools.wraps(runner)
        def tuned(*args, **kwargs):
            tuning = current()
            if tuning is None:
                return runner(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            if bound.arguments.get("schedule") != "auto":
                return runner(*args, **kwargs)

            def run(candidate):
                call = dict(bound.arguments, schedule=candidate["schedule"])
                return runner(**call)
            key = {"runner": runner.__name__, "source": source(bound.arguments), **tuning.shape}
            winner = tuning.tuner.lookup(key, (runner.__name__, key["source"], tuning.shape_text))
            if winner is None:
                line = f"hladsl: tuning the schedule of {progress.module_label(key['source'])}..."
                winner = tuning.tuner.tune(key, [{"schedule": s} for s in schedules], run, line)
            return run(winner)
        return tuned
    return wrap
