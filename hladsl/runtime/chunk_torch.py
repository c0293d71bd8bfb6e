"""Runs the generated torch lowering of a chunk program (hladsl.codegen.torch_gen):
the CPU path of the op and the reference for the Triton kernels. ``Env`` hands
the generated terms their operands; every tile carries leading batch dims
[N, H, (chunks)]."""
from __future__ import annotations

import torch

from hladsl.codegen.torch_gen import torch_module
from hladsl.ir.chunk import ChunkProgram
from hladsl.runtime.packing import combos, multiplicity


class Env:
    """Operands of one chunk (or of all chunks at once, batched)."""

    def __init__(self, tokens, lam, carry, chunk, dtype, derived=None):
        self.tokens, self.lam, self.carried, self.chunk, self.dtype = tokens, lam, carry, chunk, dtype
        self.derived_values = derived or {}
        self._cache = {}

    def token(self, name):
        return self.tokens[name]

    def power(self, name: str, packed: str, p: int, weighted: bool) -> torch.Tensor:
        """spow(x)[..., α] = Π_r x[..., α_r] over the packed multi-indices α of
        ``packed`` (times the multiplicity m(α) when ``weighted``)."""
        key = ("power", name, p, weighted)
        if key not in self._cache:
            x = self.tokens[name]
            index = combos(x.shape[-1], p).to(x.device)
            value = x[..., index[:, 0]]
            for r in range(1, p):
                value = value * x[..., index[:, r]]
            if weighted:
                value = value * multiplicity(x.shape[-1], p).to(device=x.device, dtype=value.dtype)
            self._cache[key] = value
        return self._cache[key]

    def carry(self, name):
        return self.carried[name]

    def derived(self, name):
        return self.derived_values[name]

    def mask(self, rel: str, weight: int) -> torch.Tensor:
        """M[b, a] = [a rel b] · exp(W (Λ_b − Λ_a)), zero (not inf) where masked."""
        key = ("mask", rel, weight)
        if key not in self._cache:
            device = next(iter(self.tokens.values())).device
            rows = torch.arange(self.chunk, device=device)
            keep = rows[:, None] >= rows[None, :] if rel == "<=" else rows[:, None] > rows[None, :]
            if self.lam is None or weight == 0:
                value = keep.to(self.dtype)
            else:
                diff = weight * (self.lam[..., :, None] - self.lam[..., None, :])
                value = torch.exp(diff.masked_fill(~keep, float("-inf")))
            self._cache[key] = value
        return self._cache[key]

    def decay(self, anchor: str, weight: int) -> torch.Tensor:
        """exp(W (Λ_end − Λ_a)) over a chunk ('end'), or exp(W Λ_t) ('start')."""
        key = ("decay", anchor, weight)
        if key not in self._cache:
            lam = self.lam
            self._cache[key] = torch.exp(weight * (lam[..., -1:] - lam)) if anchor == "end" \
                else torch.exp(weight * lam)
        return self._cache[key]


def state_pass(program: ChunkProgram, tokens, lam, initial: dict[str, torch.Tensor], dtype):
    """Sequential over chunks: the state at the start of every chunk, and the final one.

    tokens: name -> [N, H, nC, C, dim]; lam: [N, H, nC, C] in-chunk cumulative log gates."""
    module = torch_module(program)
    n_chunks = next(iter(tokens.values())).shape[2]
    everything = Env(tokens, lam, {}, program.chunk, dtype)
    local_only = {}   # terms that read no carried state: all chunks at once
    for name, terms in module.STATES.items():
        parts = [fn(everything) for fn, reads, _ in terms if not reads]
        local_only[name] = sum(parts) if parts else None
    state = dict(initial)
    starts = {name: [] for name in module.STATES}
    for c in range(n_chunks):
        for name in starts:
            starts[name].append(state[name])
        env = Env({k: v[:, :, c] for k, v in tokens.items()},
                  None if lam is None else lam[:, :, c], state, program.chunk, dtype)
        end = None if lam is None else lam[:, :, c, -1]
        new = {}
        for name, terms in module.STATES.items():
            total = local_only[name][:, :, c] if local_only[name] is not None else 0
            for fn, reads, carry_weight in terms:
                if not reads:
                    continue
                value = fn(env)
                if carry_weight and end is not None:   # carried state decays by ρ_chunk^w
                    value = value * torch.exp(carry_weight * end).reshape(
                        end.shape + (1,) * (value.dim() - end.dim()))
                total = total + value
            new[name] = total
        state = new
    stacked = {name: torch.stack(v, dim=2) for name, v in starts.items()}
    return stacked, state


def outputs(program: ChunkProgram, which, tokens, lam, chunk_starts, dtype) -> torch.Tensor:
    """All chunks in parallel: Σ of the 'output' or 'normalizer' terms at every token
    (``which`` may also be ``program.output`` / ``program.normalizer``)."""
    if not isinstance(which, str):
        which = "normalizer" if which is program.normalizer and which is not program.output else "output"
    module = torch_module(program)
    env = Env(tokens, lam, chunk_starts, program.chunk, dtype)
    env.derived_values = module.derived(env)
    total = None
    for fn in (module.OUTPUT if which == "output" else module.NORMALIZER):
        value = fn(env)
        total = value if total is None else total + value
    return total


def quotient_cotangents(grad_o: torch.Tensor, num: torch.Tensor, z: torch.Tensor) -> tuple:
    """(d num, d den) of o = num / z (z = den + eps, one per row): do / z and -Σ_e do num / z²,
    and 0 where z is 0 (a padded row, or a token with zero inputs, at eps = 0: its o is 0 / 0,
    no 0 / 0 reaches the gradients). Linear in do (a mask on do would make the derivative of
    this backward with respect to do wrong at do = 0: JVPs by double backward)."""
    real = z != 0
    z = torch.where(real, z, 1.0)
    d_num = torch.where(real.unsqueeze(-1), grad_o / z.unsqueeze(-1), 0.0)
    d_den = torch.where(real, -(grad_o * num).sum(-1) / z / z, 0.0)
    return d_num, d_den


class _Quotient(torch.autograd.Function):
    """num / (den + eps) whose backward is ``quotient_cotangents`` (the kernels' rule)."""

    @staticmethod
    def forward(num, den, eps):
        return num / (den.unsqueeze(-1) + eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        num, den, eps = inputs
        ctx.save_for_backward(num, den)
        ctx.eps = eps

    @staticmethod
    def backward(ctx, grad_o):
        num, den = ctx.saved_tensors
        return (*quotient_cotangents(grad_o, num, den + ctx.eps), None)


def quotient(num: torch.Tensor, den: torch.Tensor, eps: float) -> torch.Tensor:
    """o = num / (den + eps) (num [..., dv], den [...]), differentiable as the kernels are:
    no cotangent where den + eps is 0."""
    return _Quotient.apply(num, den, eps)
