"""Layers for models: ``Mixer`` (a token mixer built on any spec) and ``Cache``.

    mixer = hladsl.nn.Mixer("hla2", hidden_size=256, num_heads=4, gate="data", conv_size=4,
                            layer_idx=0)
    y = mixer(x)                                   # training / prefill: the chunk path
    cache = hladsl.nn.Cache()
    y = mixer(prompt, cache=cache)                 # prefill, fills the cache
    y = mixer(next_token, cache=cache)             # decode: op.step on the cached state

The conventions follow flash-linear-attention's layers: q, k, v (and gate)
projections from the hidden state, an optional short causal depthwise convolution
(SiLU after it), feature maps on q and k, the op, a per-head RMSNorm on the output
(optionally gated by SiLU of a projection), and an output projection.

Any spec works: the layer projects one tensor per token input the spec declares
(q, k, v for the shipped specs; ``<name>_proj``), each [B, T, H, head_dim].

Feature maps (``feature_map=``; applied after the convolution to the inputs that are
not on the output's value dim: q and k for the shipped specs):
  "identity"  the projections as they are. Fine for unnormalised first-order specs
              (linear) and for power with even p (its scores (q.k)^p are >= 0).
  "elu+1"     elu(x) + 1 > 0: every score q.k is positive, so the normaliser of a
              normalised spec (normalize=True) is a sum of positive terms and never
              crosses zero. The default when normalize=True.
  "relu"      >= 0: the same for normalisers, but a token can have all-zero
              features (its normaliser is then only eps).
  "l2"        unit vectors per head: |q.k| <= 1, so the products of several scores in
              higher-order specs (hla2, ahla, hla3, hla3_masked, power p >= 3) stay
              bounded; a good default for unnormalised higher-order specs.
  "softmax"   softmax over the head dim: positive and on the simplex (both of the
              above: positive normalisers and scores in [0, 1]).

Gates (``gate=``): None; "scalar", a learned per-head decay gamma = sigmoid(a_h)
(g_t = log gamma, initialised RetNet-style 1 - 2^-(5+h)); "data", fla's simple GLA
gate g_t = logsigmoid(W_g x_t) / 16 per token and head. Both give g <= 0.

Padding: ``attention_mask`` [B, T'] (1 = token, 0 = pad; T' >= T, its last T columns
are used, as with a Hugging Face mask that covers the past) zeroes the padded
tokens' projections before the convolution, so the convolution sees them as the
zero history of an unpadded sequence, and zeroes their q, k, v and gate after the
feature maps: a token whose inputs are all zero has a zero delta for every summary
(every delta is a product of token inputs), and with g = 0 it leaves the state as it
is, so left padding gives the real tokens exactly the unpadded outputs, normalised
specs included (a padded token's own output is set to 0: its quotient is 0 / (0 + eps),
NaN at eps = 0). Padding in the
middle of a sequence is skipped by the op but not by the convolution.

Varlen (``cu_seqlens``, B = 1, FlashAttention style): the convolution restarts at
every sequence start; with a cache, prefill stores one state and one conv tail per
sequence, and later calls decode with B = number of sequences.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import hladsl

FEATURE_MAPS = {
    "identity": lambda x: x,
    "elu+1": lambda x: F.elu(x) + 1.0,
    "relu": F.relu,
    "l2": lambda x: F.normalize(x, dim=-1),
    "softmax": lambda x: x.softmax(dim=-1),
}
GATES = (None, "scalar", "data")
OUTPUT_NORMS = (True, False, "gated")
DECODE_MAX_TOKENS = 64      # a cached call with at most this many tokens uses op.step
GATE_LOGIT_NORMALIZER = 16  # fla's simple GLA: logsigmoid(W x) / 16 keeps early decay mild
NORM_EPS = 1e-5


@dataclass
class LayerCache:
    """What one layer keeps between calls. ``state``: the op's state dict
    {summary: [N, H, *shape]} (op layout); ``conv``: the last conv_size - 1 inputs
    of the convolution [N, conv_size - 1, channels]; ``offsets``: real tokens seen
    per sequence [N] (padding excluded)."""
    state: dict | None = None
    conv: torch.Tensor | None = None
    offsets: torch.Tensor | None = None


class Cache:
    """The decoding cache of a whole model, one ``LayerCache`` per ``layer_idx``,
    updated in place by the layers."""

    def __init__(self):
        self.layers: dict[int, LayerCache] = {}

    def __getitem__(self, layer_idx: int) -> LayerCache:
        return self.layers.setdefault(layer_idx, LayerCache())

    def __contains__(self, layer_idx: int) -> bool:
        return layer_idx in self.layers and self.layers[layer_idx].state is not None

    def __len__(self) -> int:
        return len(self.layers)

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        """Tokens seen so far (the longest sequence), 0 before the first call."""
        if not self.layers:
            return 0
        entry = self.layers.get(min(self.layers) if layer_idx is None else layer_idx)
        if entry is None or entry.offsets is None:
            return 0
        return int(entry.offsets.max())

    def reorder(self, index: torch.Tensor) -> None:
        """Keep the sequences ``index`` selects (beam search), in place."""
        for entry in self.layers.values():
            if entry.state is not None:
                entry.state = {n: x.index_select(0, index.to(x.device)) for n, x in entry.state.items()}
            if entry.conv is not None:
                entry.conv = entry.conv.index_select(0, index.to(entry.conv.device))
            if entry.offsets is not None:
                entry.offsets = entry.offsets.index_select(0, index.to(entry.offsets.device))

    def reset(self) -> None:
        self.layers.clear()


class Mixer(nn.Module):
    """A sequence-mixing layer on ``hladsl.load(spec, **spec_params)`` (see the
    module docstring). x: [B, T, hidden_size] -> y: [B, T, hidden_size]."""

    def __init__(self, spec, hidden_size: int, num_heads: int, head_dim: int | None = None,
                 gate: str | None = None, feature_map: str | None = None,
                 normalize: bool | None = None, output_norm: bool | str = True,
                 conv_size: int | None = None, layer_idx: int | None = None, **spec_params):
        super().__init__()
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads "
                                 f"{num_heads}; give head_dim")
            head_dim = hidden_size // num_heads
        if gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
        if feature_map is None:
            feature_map = "elu+1" if normalize else "identity"
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be one of {sorted(FEATURE_MAPS)}, got {feature_map!r}")
        if output_norm not in OUTPUT_NORMS:
            raise ValueError(f"output_norm must be True, False or 'gated', got {output_norm!r}")
        if conv_size is not None and (not isinstance(conv_size, int) or conv_size < 1):
            raise ValueError(f"conv_size must be a positive int or None, got {conv_size!r}")
        if normalize is not None:
            spec_params["normalize"] = normalize
        self.op = hladsl.load(spec, **spec_params)
        self.spec = spec
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.value_dim = num_heads * head_dim
        # one projection per token input the spec declares (q, k, v for the shipped
        # ones), in declaration order; the feature map applies to the inputs that
        # are not on the output's (value) dim, i.e. the query/key side
        alg = self.op.algebra
        self.token_inputs = tuple(self.op.inputs)
        self.mapped_inputs = tuple(n for n in self.token_inputs if alg.inputs[n] != self.op.out_dim)
        self.gate, self.feature_map, self.output_norm = gate, feature_map, output_norm
        self.conv_size, self.layer_idx = conv_size, layer_idx

        for name in self.token_inputs:   # q_proj, k_proj, v_proj (spec names are identifiers)
            setattr(self, f"{name}_proj", nn.Linear(hidden_size, self.value_dim, bias=False))
        channels = len(self.token_inputs) * self.value_dim
        if conv_size is not None:   # depthwise, as nn.Conv1d(groups=channels) initialises it
            bound = 1.0 / math.sqrt(conv_size)
            self.conv_weight = nn.Parameter(torch.empty(channels, conv_size).uniform_(-bound, bound))
        if gate == "scalar":        # RetNet's gammas 1 - 2^-(5+h), learned from there
            gamma = 1 - 2.0 ** (-5.0 - torch.arange(num_heads, dtype=torch.float64))
            self.decay_logit = nn.Parameter(torch.log(gamma / (1 - gamma)).float())
        elif gate == "data":
            self.g_proj = nn.Linear(hidden_size, num_heads, bias=True)
        if output_norm:
            self.norm_weight = nn.Parameter(torch.ones(head_dim))
        if output_norm == "gated":
            self.out_gate_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def extra_repr(self) -> str:
        return (f"spec={self.spec!r}, hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
                f"head_dim={self.head_dim}, gate={self.gate!r}, feature_map={self.feature_map!r}, "
                f"output_norm={self.output_norm!r}, conv_size={self.conv_size}, "
                f"layer_idx={self.layer_idx}")

    def state_bytes(self, dtype=torch.float32) -> int:
        """Bytes of the op's recurrent state per sequence (all heads)."""
        shapes = self.op.state_shapes(**{d: self.head_dim for d in self.op.algebra.dims})
        per_head = sum(math.prod(s) for s in shapes.values())
        return per_head * self.num_heads * torch.empty((), dtype=dtype).element_size()

    # -- forward ---------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cache: Cache | None = None,
                cu_seqlens: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be [B, T, hidden_size={self.hidden_size}], got {got}")
        B, T, _ = x.shape
        mask = self._token_mask(attention_mask, B, T, x)
        if mask is not None and cu_seqlens is not None:
            raise ValueError("give attention_mask or cu_seqlens, not both")
        entry = None
        if cache is not None:
            if self.layer_idx is None:
                raise ValueError("a Mixer used with a cache needs layer_idx (its key in the cache)")
            entry = cache[self.layer_idx]

        proj = torch.cat([getattr(self, f"{n}_proj")(x) for n in self.token_inputs], dim=-1)
        if mask is not None:
            proj = proj * mask.unsqueeze(-1)
        if self.conv_size is not None:
            proj = F.silu(self._conv(proj, entry, cu_seqlens))
        H, fmap = self.num_heads, FEATURE_MAPS[self.feature_map]
        tokens = {}
        for name, part in zip(self.token_inputs, proj.split(self.value_dim, dim=-1)):
            part = part.reshape(B, T, H, self.head_dim)
            # a feature map may compute in fp32 (autocast runs norms in fp32): the op takes
            # every token input in one dtype, the projections'
            tokens[name] = fmap(part).to(part.dtype) if name in self.mapped_inputs else part
        g = self._log_gate(x)
        if mask is not None:   # padded tokens: zero delta, no decay (module docstring)
            m = mask.unsqueeze(-1)
            tokens = {name: t * m.unsqueeze(-1) for name, t in tokens.items()}
            g = None if g is None else g * m

        args = [tokens[n] for n in self.token_inputs]
        state = entry.state if entry is not None else None
        if state is not None and T <= DECODE_MAX_TOKENS and cu_seqlens is None:
            o, _ = self.op.step(*args, g=g, state=state)   # updates entry.state in place
        else:
            o, final = self.op(*args, g=g, initial_state=state,
                               output_final_state=entry is not None, cu_seqlens=cu_seqlens)
            if entry is not None:
                entry.state = final
        if mask is not None:   # (a padded token's output: 0, not a normaliser's 0 / 0 at eps = 0)
            o = torch.where(mask[:, :, None, None] > 0, o, 0.0)
        if entry is not None:
            entry.offsets = _advance(entry.offsets, mask, cu_seqlens, B, T, x.device)
        return self.o_proj(self._output(o, x).reshape(B, T, self.value_dim))

    # -- pieces ----------------------------------------------------------------------
    def _token_mask(self, attention_mask, B, T, x):
        if attention_mask is None:
            return None
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 \
                or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
            got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) \
                else type(attention_mask).__name__
            raise ValueError(f"attention_mask must be [B, T'] with B = {B} and T' >= T = {T} "
                             f"(1 = token, 0 = padding), got {got}")
        return attention_mask[:, -T:].to(device=x.device, dtype=x.dtype)

    def _log_gate(self, x):
        """Log gates [B, T, H] <= 0, at least fp32 (the op sums them over a chunk)."""
        B, T, _ = x.shape
        precise = torch.promote_types(x.dtype, torch.float32)
        if self.gate == "scalar":
            return F.logsigmoid(self.decay_logit.to(precise)).expand(B, T, self.num_heads)
        if self.gate == "data":
            return F.logsigmoid(self.g_proj(x).to(precise)) / GATE_LOGIT_NORMALIZER
        return None

    def _conv(self, proj, entry, cu_seqlens):
        """Causal depthwise convolution over time; the cache keeps its input tail."""
        W = self.conv_size
        N, T, channels = proj.shape
        tail = entry.conv if entry is not None else None
        if tail is not None and cu_seqlens is not None:
            raise ValueError("cu_seqlens with a cache that already holds a conv tail is not "
                             "supported: decode the packed sequences as a batch [N, T, ...]")
        if tail is not None and tail.shape[0] != N:
            raise ValueError(f"the cache holds {tail.shape[0]} sequences but x has batch size {N}")
        if tail is None:
            tail = proj.new_zeros(N, W - 1, channels)
        padded = torch.cat([tail.to(proj.dtype), proj], dim=1)     # [N, W - 1 + T, C]
        weight = self.conv_weight.to(proj.dtype)
        pos = _positions_in_sequence(cu_seqlens, T, proj.device)   # None: no restarts
        out = 0
        for w in range(W):      # tap w reaches back W - 1 - w tokens
            term = padded[:, w:w + T] * weight[:, w]
            if pos is not None:
                term = term * (pos >= W - 1 - w).to(proj.dtype).unsqueeze(-1)
            out = out + term
        if entry is not None:
            if cu_seqlens is None:
                entry.conv = padded[:, padded.shape[1] - (W - 1):]
            else:
                entry.conv = _varlen_tails(proj[0], cu_seqlens, W - 1)
        return out

    def _output(self, o, x):
        if self.output_norm:   # in at least fp32 (bf16 outputs), fp64 kept
            wide = o.to(torch.promote_types(o.dtype, torch.float32))
            rms = wide.pow(2).mean(-1, keepdim=True).add(NORM_EPS).rsqrt()
            o = (wide * rms).to(o.dtype) * self.norm_weight.to(o.dtype)
        if self.output_norm == "gated":
            gate = self.out_gate_proj(x).reshape(o.shape)
            o = o * F.silu(gate)
        return o


def _positions_in_sequence(cu_seqlens, T, device):
    """Per token, its index within its own sequence (None without cu_seqlens)."""
    if cu_seqlens is None:
        return None
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    t = torch.arange(T, device=device)
    seq = torch.searchsorted(bounds, t, right=True) - 1
    return (t - bounds[seq]).unsqueeze(0)


def _varlen_tails(flat, cu_seqlens, width):
    """The last ``width`` inputs of each packed sequence, zeros where it is shorter."""
    bounds = cu_seqlens.tolist()
    tails = flat.new_zeros(len(bounds) - 1, width, flat.shape[-1])
    for n, (a, b) in enumerate(zip(bounds, bounds[1:])):
        take = min(width, b - a)
        if take:
            tails[n, width - take:] = flat[b - take:b]
    return tails


def _advance(offsets, mask, cu_seqlens, B, T, device):
    if cu_seqlens is not None:
        seen = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=device, dtype=torch.long)
    elif mask is not None:
        seen = (mask > 0).sum(1).long()
    else:
        seen = torch.full((B,), T, dtype=torch.long, device=device)
    return seen if offsets is None else offsets + seen
