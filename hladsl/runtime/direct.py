"""Launching a compiled Triton kernel directly, without ``JITFunction.run``.

``kernel[grid](**args)`` binds every argument, builds Triton's cache key (the
specialization of each argument and a string of the options), checks the kernel's
globals and looks the binary up -- per launch, for kernels of 40-70 arguments.
Once a variant has compiled, ``call`` keeps its ``CompiledKernel`` under a key of
what Triton specializes on -- each constexpr's value, each tensor's dtype and
16-byte alignment, each int's class (== 1, divisible by 16, 32 or 64 bits), the
options -- and launches the binary with the arguments in parameter order. The key
is at least as fine as Triton's, so a hit is the binary ``kernel[grid]`` would
have launched. The first launch of a variant, the Triton interpreter (CPU) and
``HLADSL_DIRECT_LAUNCH=0`` go through ``kernel[grid](**args)``.
"""
from __future__ import annotations

import os

import torch

_COMPILED: dict = {}   # launch key -> (CompiledKernel, parameter names, defaults)
_PARAMS: dict = {}     # id(kernel) -> (kernel, its parameter table, or None: not direct)
_I32 = 1 << 31
ENABLED = os.environ.get("HLADSL_DIRECT_LAUNCH", "1") != "0"   # benchmarks flip it for A/B runs


def launches_on_gpu(kernel) -> bool:
    """A Triton JITFunction compiled for a GPU (not the interpreter's, not a fake)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    from triton.runtime.jit import JITFunction
    return isinstance(kernel, JITFunction)


def _param_table(kernel):
    """(names, constexpr flags, defaults) of a jitted GPU kernel; None for anything else."""
    hit = _PARAMS.get(id(kernel))
    if hit is not None and hit[0] is kernel:
        return hit[1]
    params = getattr(kernel, "params", None)
    table = None
    if params is not None and launches_on_gpu(kernel):
        names = tuple(p.name for p in params)
        table = (names, tuple(bool(p.is_constexpr) for p in params),
                 tuple(p.default if getattr(p, "has_default", False) else None for p in params),
                 frozenset(names))
    _PARAMS[id(kernel)] = (kernel, table)
    return table


def _arg_class(value):
    """What Triton specializes a runtime argument on."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() & 15 == 0
    kind = type(value)
    if kind is int:
        return value == 1, value & 15 == 0, -_I32 <= value < _I32, value < 1 << 63
    if kind is float or value is None:
        return kind
    return kind, value   # bools and anything else: by value (finer than Triton is safe)


def _key(kernel, table, args: dict) -> tuple:
    names, constexpr, defaults, params = table
    parts = [id(kernel), torch.cuda.current_device()]
    for name, fixed, default in zip(names, constexpr, defaults):
        value = args.get(name, default)
        parts.append(value if fixed else _arg_class(value))
    # every launch option (num_warps, num_stages, maxnreg, enable_fp_fusion, ...) and the
    # process-wide ones Triton reads at launch: each is part of Triton's key too
    options = [(k, v) for k, v in args.items() if k not in params]
    parts.append(tuple(sorted(options)) if len(options) > 1 else tuple(options))
    knobs = _knobs()
    parts.append((knobs.runtime.debug, getattr(knobs.compilation, "instrumentation_mode", None)))
    return tuple(parts)


def _knobs():
    from triton import knobs
    return knobs


def variant_key(kernel, args: dict) -> tuple:
    """What Triton compiles a GPU kernel's launch with ``args`` on (``_key``: constexprs,
    argument dtypes and classes, options, device), for a table of compiled variants."""
    return _key(kernel, _param_table(kernel), args)


def call(kernel, grid, args: dict, key_args: dict | None = None) -> None:
    """``kernel[grid](**args)``, directly where this variant compiled before.
    ``key_args``: the arguments the variant is remembered under, when ``args`` adds
    launch options to them (``launch``'s fallbacks)."""
    table = _param_table(kernel) if ENABLED else None
    if table is None:
        check_arguments(kernel, args)
        kernel[grid](**args)
        return
    key = _key(kernel, table, key_args if key_args is not None else args)
    hit = _COMPILED.get(key)
    if hit is None:
        compiled = kernel[grid](**args)
        if hasattr(compiled, "function") and hasattr(compiled, "packed_metadata"):
            _COMPILED[key] = compiled
        return
    _run(hit, grid, table, args)


LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion"})


def check_arguments(kernel, args: dict) -> None:
    """A TypeError naming the arguments ``kernel`` has no parameter for. Triton raises on a
    GPU; its interpreter ignores them, so a CPU test would not see a launch the GPU refuses."""
    names = getattr(kernel, "arg_names", None)
    if names is None:
        return
    unknown = args.keys() - set(names) - LAUNCH_OPTIONS
    if unknown:
        label = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel")
        raise TypeError(f"{label} has no parameter(s) {', '.join(sorted(unknown))}")


def cached(kernel, grid, args: dict) -> bool:
    """Launch ``kernel`` directly if this variant compiled before; False if not."""
    hit, table = _compiled(kernel, args)
    if hit is None:
        return False
    _run(hit, grid, table, args)
    return True


def _compiled(kernel, args: dict):
    """(the compiled variant of ``args`` or None, the kernel's parameter table or None
    where launches are not direct)."""
    table = _param_table(kernel) if ENABLED else None
    return (None if table is None else _COMPILED.get(_key(kernel, table, args))), table


def _run(compiled, grid, table, args: dict) -> None:
    names, _, defaults, _ = table
    _launch(compiled, (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1),
            [args.get(n, d) for n, d in zip(names, defaults)])


def _launch(compiled, grid: tuple, values: list) -> None:
    """The binary on the current stream, Triton's launch hooks included."""
    hooks = _knobs().runtime
    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
    meta = compiled.launch_metadata(grid, stream, *values) if hooks.launch_enter_hook else None
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, meta,
                 hooks.launch_enter_hook, hooks.launch_exit_hook, *values)


class Bound:
    """One compiled variant with its arguments in parameter order, for calls that differ
    only in their tensors (the caller keys it by what Triton specialises on: dtypes,
    16-byte alignment, shapes and strides): ``launch`` fills the tensors in and runs the
    binary, no argument binding and no key."""

    def __init__(self, compiled, grid, values: list, slots: list[int]):
        self.compiled, self.slots = compiled, slots
        self.grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self.values = values

    def launch(self, tensors) -> None:
        values = self.values.copy()
        for slot, x in zip(self.slots, tensors):
            values[slot] = x
        _launch(self.compiled, self.grid, values)


def bind(kernel, grid, args: dict, tensors: list[str]) -> Bound | None:
    """The variant ``call`` launched for ``args``, bound (None where launches are not
    direct or it has not compiled): later calls pass the values of ``tensors`` only (the
    template keeps none of this call's tensors alive)."""
    compiled, table = _compiled(kernel, args)
    if compiled is None:
        return None
    names, _, defaults, _ = table
    slots = [names.index(n) for n in tensors]
    values = [None if i in slots else args.get(n, d) for i, (n, d) in enumerate(zip(names, defaults))]
    return Bound(compiled, grid, values, slots)
