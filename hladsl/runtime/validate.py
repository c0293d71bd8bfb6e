"""Input validation for the op: every problem is a ValueError naming the argument."""
from __future__ import annotations

import math
import os

import torch

from hladsl.ir.algebra import Algebra
from hladsl.runtime.packing import packed_shape

FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _tensor(name, x, ndim):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_TYPES:
        raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")


def check_inputs(alg: Algebra, tokens: dict, g, scale, cu_seqlens, data_checks: bool = True
                 ) -> dict[str, int]:
    """Validate the token inputs (by declared name), g, scale and cu_seqlens; return
    the dim sizes. ``data_checks=False`` skips what reads tensor values (gate signs,
    cu_seqlens contents): under torch.compile they would break the graph."""
    names = list(tokens)
    for name in names:
        _tensor(name, tokens[name], 4)
    first = tokens[names[0]]
    B, T, H, _ = first.shape
    for name in names[1:]:
        x = tokens[name]
        if x.shape[:3] != first.shape[:3]:
            raise ValueError(f"{name} must have {names[0]}'s [B, T, H] = {tuple(first.shape[:3])}, "
                             f"got {tuple(x.shape[:3])}")
        if x.device != first.device:
            raise ValueError(f"{name} is on {x.device} but {names[0]} is on {first.device}")
        if x.dtype != first.dtype:
            raise ValueError(f"{name} has dtype {x.dtype} but {names[0]} has {first.dtype}")
    dims: dict[str, int] = {}
    for name in names:
        dim, size = alg.inputs[name], tokens[name].shape[-1]
        if dims.setdefault(dim, size) != size:
            raise ValueError(f"{name} has last dimension {size} but the spec gives it dim "
                             f"'{dim}' = {dims[dim]}")
    if g is not None:
        if not isinstance(g, torch.Tensor) or g.dim() != 3 or tuple(g.shape) != (B, T, H):
            raise ValueError(f"g must be a tensor of shape [B, T, H] = {(B, T, H)}, got "
                             f"{tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__}")
        if g.dtype not in FLOAT_TYPES:
            raise ValueError(f"g must be a floating tensor, got {g.dtype}")
        if g.device != first.device:
            raise ValueError(f"g is on {g.device} but {names[0]} is on {first.device}")
        if data_checks and not bool(torch.isfinite(g).all()):
            raise ValueError("g must be finite")
        if data_checks and bool((g > 0).any()):
            raise ValueError("g holds log decays and must be <= 0 (got a positive entry)")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or \
                cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor")
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1, got B = {B}")
        if cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens needs at least two entries [0, ..., T]")
        if cu_seqlens.device != first.device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but {names[0]} is on "
                             f"{first.device}")
        if not data_checks:
            return dims
        c = cu_seqlens.tolist()
        if c[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {c[0]}")
        if any(b < a for a, b in zip(c, c[1:])):
            raise ValueError("cu_seqlens must be non-decreasing")
        if c[-1] != T:
            raise ValueError(f"cu_seqlens must end at T = {T}, got {c[-1]}")
    return dims


def check_state(alg: Algebra, state, n: int, h: int, dims: dict[str, int], device) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"initial_state must be a dict of tensors, got {type(state).__name__}")
    want = {s.name: s for s in alg.streaming}
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    if missing or extra:
        raise ValueError(f"initial_state must have exactly the entries {sorted(want)}; "
                         + (f"missing {missing}" if missing else "")
                         + ("; " if missing and extra else "") + (f"unexpected {extra}" if extra else ""))
    for name, s in want.items():
        x = state[name]
        shape = (n, h) + packed_shape(s, dims)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"initial_state['{name}'] must have shape {shape}, got {got}")
        if x.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"initial_state['{name}'] must be float32 (or float64), got {x.dtype}")
        if x.device != device:
            raise ValueError(f"initial_state['{name}'] is on {x.device} but q is on {device}")


def check_step_state(state: dict, state_indices, B: int, T: int, device) -> None:
    """What a decode step needs beyond ``check_inputs`` and ``check_state``: at least one
    token, one dtype for every state tensor (one kernel updates them all) and
    state_indices [B] ints on the tokens' device."""
    if T < 1:
        raise ValueError("tokens must hold at least one token (T >= 1)")
    dtypes = {x.dtype for x in state.values()}
    if len(dtypes) != 1:
        raise ValueError(f"state tensors must all be float32 or all float64, got {sorted(map(str, dtypes))}")
    if state_indices is not None and (
            not isinstance(state_indices, torch.Tensor) or tuple(state_indices.shape) != (B,)
            or state_indices.dtype not in (torch.int32, torch.int64) or state_indices.device != device):
        raise ValueError(f"state_indices must be an int32/int64 tensor [B] = [{B}] on {device}")


def value_checks(x) -> bool:
    """Check the values of g (finite, <= 0)? Reading a CUDA tensor's values waits for
    the GPU (a host sync per call that stalls the launch queue), so on CUDA only when
    HLADSL_CHECK_VALUES=1; never while torch.compile traces or a CUDA graph is captured."""
    if torch.compiler.is_compiling():
        return False
    on_cuda = isinstance(x, torch.Tensor) and x.device.type == "cuda"   # x is not validated yet
    if not on_cuda:
        return True
    # asked for, still never while a CUDA graph is captured (a sync there is an error)
    return os.environ.get("HLADSL_CHECK_VALUES") == "1" and not torch.cuda.is_current_stream_capturing()
