"""Packed storage of symmetric summaries: a group of p symmetric slots over a
dim of size n is stored as its C(n+p-1, p) entries with non-decreasing
indices (D = 2080 for n = 64, p = 2), at the position of the group's first slot."""
from __future__ import annotations

import itertools
from functools import lru_cache
from math import comb

import torch

from hladsl.ir.algebra import Summary
from hladsl.ir.symmetric import multiplicities


def packed_shape(s: Summary, dims: dict[str, int]) -> tuple[int, ...]:
    shape, skip = [], set()
    for group in s.symmetric:
        skip.update(group[1:])
    for slot, d in enumerate(s.dims):
        if slot in skip:
            continue
        group = next((g for g in s.symmetric if g[0] == slot), None)
        n = dims[d]
        shape.append(comb(n + len(group) - 1, len(group)) if group else n)
    return tuple(shape)


@lru_cache(maxsize=256)
def combos(n: int, p: int) -> torch.Tensor:
    return torch.tensor(list(itertools.combinations_with_replacement(range(n), p)), dtype=torch.long)


@lru_cache(maxsize=256)
def multiplicity(n: int, p: int) -> torch.Tensor:
    """m(α): how many full multi-indices each packed entry stands for (fp64)."""
    return torch.tensor(multiplicities(n, p), dtype=torch.float64)


@lru_cache(maxsize=256)
def row_tiles(n: int, p: int, width: int) -> torch.Tensor:
    """The packed entries cut into *row tiles* (``triton_gen``'s POWER_COLUMNS "rows"): a tile
    fixes the first p - 1 indices (a prefix) and takes a block of ``width`` last indices
    aligned to ``width``. In the packed order a prefix's entries are contiguous, its last index
    running from the prefix's last one to n - 1, so a tile is one run of positions; the
    entries of its block below the prefix's last index (or past n) are not its own. int32
    [tiles, p + 1]: the prefix, the block's first index b0, and the position the entry
    (prefix, b0) would have (its valid entries' positions follow it)."""
    position = {c: k for k, c in enumerate(itertools.combinations_with_replacement(range(n), p))}
    rows = []
    for prefix in itertools.combinations_with_replacement(range(n), p - 1):
        low = prefix[-1] if prefix else 0
        first = position[prefix + (low,)]
        for b0 in range(low - low % width, n, width):
            rows.append([*prefix, b0, first + b0 - low])
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), p + 1)


@lru_cache(maxsize=256)
def _positions(n: int, p: int) -> torch.Tensor:
    """For every full multi-index (row-major over p slots), its packed position."""
    lookup = {c: k for k, c in enumerate(itertools.combinations_with_replacement(range(n), p))}
    return torch.tensor([lookup[tuple(sorted(idx))] for idx in itertools.product(range(n), repeat=p)],
                        dtype=torch.long)


@lru_cache(maxsize=256)
def _flat_combos(n: int, p: int) -> torch.Tensor:
    """Row-major flat position of every packed multi-index in the full [n]^p block."""
    return (combos(n, p) * torch.tensor([n ** (p - 1 - j) for j in range(p)])).sum(-1)


@lru_cache(maxsize=256)
def slots(n: int, p: int) -> torch.Tensor:
    """[p, D] int32: slot r of every packed multi-index (the kernels' pk_<dim>_idx)."""
    return combos(n, p).t().contiguous().to(torch.int32)


@lru_cache(maxsize=256)
def multiplicity_fp32(n: int, p: int) -> torch.Tensor:
    """m(α) in fp32 (the kernels' pk_<dim>_mult)."""
    return multiplicity(n, p).to(torch.float32)


_DEVICE_TABLES: dict = {}


def on_device(table, device, *args) -> torch.Tensor:
    """``table(*args)`` (one of this module's cached host tables) on ``device``, made there once:
    a copy per call would wait for the GPU. Copied to a GPU from pinned memory, asynchronously
    (a first call does not sync either)."""
    key = (table.__name__, args, str(device))
    got = _DEVICE_TABLES.get(key)
    if got is None:
        host = table(*args)
        got = _DEVICE_TABLES[key] = (host.pin_memory().to(device, non_blocking=True)
                                     if torch.device(device).type == "cuda" else host.to(device))
    return got


def pack(s: Summary, full: torch.Tensor, dims: dict[str, int]) -> torch.Tensor:
    """[..., *full_shape] -> [..., *packed_shape]."""
    lead = full.dim() - len(s.dims)
    x = full
    for group in sorted(s.symmetric, key=lambda g: -g[0]):
        x = _pack_group(x, lead, group, dims[s.dims[group[0]]])
    return x


def unpack(s: Summary, packed: torch.Tensor, dims: dict[str, int]) -> torch.Tensor:
    lead = packed.dim() - len(packed_shape(s, dims))
    x = packed
    for group in sorted(s.symmetric, key=lambda g: g[0]):
        x = _unpack_group(x, lead, group, dims[s.dims[group[0]]], s)
    return x


def _pack_group(x, lead, group, n):
    p = len(group)
    # bring the group's slots to the end, flatten them, gather the sorted multi-indices
    slots = [lead + g for g in group]
    rest = [k for k in range(x.dim()) if k not in slots]
    moved = x.permute(rest + slots).reshape(*[x.shape[k] for k in rest], n ** p)
    packed = moved.index_select(-1, on_device(_flat_combos, x.device, n, p))
    first = lead + group[0]
    order = list(range(packed.dim() - 1))
    order.insert(first, packed.dim() - 1)
    return packed.permute(order)


def _unpack_group(x, lead, group, n, s):
    p = len(group)
    first = lead + group[0]
    moved = x.movedim(first, -1)
    full = moved.index_select(-1, on_device(_positions, x.device, n, p))
    full = full.reshape(*moved.shape[:-1], *([n] * p))
    # put the p slots back at their positions
    base = list(range(moved.dim() - 1))
    result_dims = moved.dim() - 1 + p
    order = [None] * result_dims
    slots = [lead + g for g in group]
    others = iter(base)
    for k in range(result_dims):
        if k in slots:
            order[k] = moved.dim() - 1 + slots.index(k)
        else:
            order[k] = next(others)
    return full.permute(order)
