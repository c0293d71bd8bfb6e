"""Tests of the torch op (hladsl.runtime.op) against the float64 brute-force oracles.

Covers DESIGN.md sections 3, 6 and 7: chunked forward, derived serial recurrence,
state passing, varlen (cu_seqlens), autograd (gradcheck), input validation,
dtypes and the layout of the state dict (packed symmetric summaries).
"""
from __future__ import annotations

import math
from itertools import combinations_with_replacement

import pytest
import torch

import hladsl

try:
    from oracles import oracle
except ImportError:  # tests/ collected as a package
    from tests.oracles import oracle

F64 = torch.float64

# (spec, load params) for every shipped mechanism; the extra variants of the brief
CONFIGS = [
    ("linear", {}),
    ("hla2", {}),
    ("hla2", {"ridge": 0.3}),
    ("ahla", {}),
    ("hla3", {}),
    ("hla3_masked", {}),
    ("power", {}),
    ("power", {"p": 3}),
    ("power", {"p": 4}),
]
SPECS = ["linear", "hla2", "ahla", "hla3", "hla3_masked", "power"]
CUBIC = {"hla3", "hla3_masked"}  # O(T^4) oracles: keep their long cases few
GATES = ["none", "const", "random"]
CONST_LOG_GAMMA = math.log(0.9)

# streaming summaries per spec (DESIGN section 3 / the .hla files); combine-only
# helpers (ahla R, hla3 X*/Y*/x*/y3, hla3_masked QQ/N/M/n) must never appear
STATES = {
    "linear": ({"S"}, {"z"}),
    "hla2": ({"S", "C", "G"}, {"m", "h"}),
    "ahla": ({"P", "E"}, {"m", "n"}),
    "hla3": ({"SK", "SQ", "P", "G1", "G2", "G3"}, {"m", "h1", "h2", "h3"}),
    "hla3_masked": ({"S", "P", "H"}, {"m", "z"}),
    "power": ({"U"}, {"z"}),
}


def cid(cfg):
    name, params = cfg
    return name + "".join(f"-{k}={v}" for k, v in params.items())


# --------------------------------------------------------------------------- helpers
def rel(a, b):
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.detach().to(F64), b.detach().to(F64)
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def make_op(name, params=None, chunk_size=64):
    return hladsl.load(name, chunk_size=chunk_size, **(params or {}))


def gen(seed):
    return torch.Generator().manual_seed(seed)


def make_inputs(B, T, H, d, dv, gate="random", seed=0, dtype=F64):
    """q, k ~ N(0, 1/d) (so q.k = O(1)), v ~ N(0, 1); g per `gate`; all float64 then cast."""
    rng = gen(seed)
    q = torch.randn(B, T, H, d, generator=rng, dtype=F64) / d ** 0.5
    k = torch.randn(B, T, H, d, generator=rng, dtype=F64) / d ** 0.5
    v = torch.randn(B, T, H, dv, generator=rng, dtype=F64)
    g = make_gate(gate, B, T, H, rng)
    def cast(x):
        return (None if x is None else x.to(dtype))
    return cast(q), cast(k), cast(v), cast(g)


def make_gate(gate, B, T, H, rng):
    if gate == "none":
        return None
    if gate == "const":
        return torch.full((B, T, H), CONST_LOG_GAMMA, dtype=F64)
    if gate == "random":
        return -0.5 * torch.rand(B, T, H, generator=rng, dtype=F64)
    raise ValueError(gate)


def oracle_all(name, params, q, k, v, g, normalize=False):
    """Oracle output [B, T, H, dv] built per (batch, head)."""
    B, T, H, _ = q.shape
    out = torch.zeros(B, T, H, v.shape[-1], dtype=F64)
    kw = dict(params, normalize=normalize)
    for b in range(B):
        for h in range(H):
            gg = None if g is None else g[b, :, h]
            out[b, :, h] = oracle(name, q[b, :, h], k[b, :, h], v[b, :, h], gg, **kw)
    return out


def assert_rel(a, b, tol, what=""):
    r = rel(a, b)
    assert r <= tol, f"{what}: relative error {r:.3e} > {tol:.0e}"


def assert_per_head(o, ref, tol, what=""):
    B, _, H, _ = ref.shape
    for b in range(B):
        for h in range(H):
            assert_rel(o[b, :, h], ref[b, :, h], tol, f"{what} (b={b}, h={h})")


def assert_states(a, b, tol, what=""):
    assert set(a) == set(b), f"{what}: state keys {sorted(a)} != {sorted(b)}"
    for name in b:
        assert a[name].shape == b[name].shape, f"{what}: {name} {a[name].shape} != {b[name].shape}"
        assert_rel(a[name], b[name], tol, f"{what} state {name}")


def random_state(op, N, H, d, dv, seed, positive=False):
    """A random (packed) initial state dict {summary: [N, H, *shape]} in float64."""
    rng = gen(seed)
    draw = torch.rand if positive else torch.randn
    return {name: 0.3 * draw((N, H) + shape, generator=rng, dtype=F64)
            for name, shape in op.state_shapes(d, dv).items()}


def row(state, n):
    """Sequence n of a state dict, keeping the leading N dim."""
    return {key: x[n:n + 1] for key, x in state.items()}


# ------------------------------------------------ 1. op and serial against the oracle
SHAPES = [(3, 4), (4, 3), (8, 4), (4, 8), (3, 3), (8, 8)]
T_DEFAULT = [64, 17, 64, 1, 17, 64]
T_CUBIC = [64, 17, 17, 1, 17, 17]  # one T = 64 case per cubic spec (oracle is O(T^4))


def oracle_cases():
    for ci, cfg in enumerate(CONFIGS):
        name, params = cfg
        for gi, gate in enumerate(GATES):
            for ni, normalize in enumerate((False, True)):
                idx = 2 * gi + ni
                T = (T_CUBIC if name in CUBIC else T_DEFAULT)[idx]
                d, dv = SHAPES[(idx + ci) % len(SHAPES)]
                if name == "power" and params.get("p", 2) > 2:
                    d = 3
                yield pytest.param(name, params, gate, normalize, T, d, dv,
                                   id=f"{cid(cfg)}-{gate}-norm{int(normalize)}-T{T}-d{d}-dv{dv}")


@pytest.mark.parametrize("name,params,gate,normalize,T,d,dv", list(oracle_cases()))
def test_matches_oracle(name, params, gate, normalize, T, d, dv):
    B, H = 2, 2
    q, k, v, g = make_inputs(B, T, H, d, dv, gate, seed=T * 100 + d * 10 + dv)
    ref = oracle_all(name, params, q, k, v, g, normalize)
    outs = {}
    for cs in (16, 64):  # chunk size 16 (multi-chunk for T > 16) and the default
        op = make_op(name, dict(params, normalize=normalize), cs)
        o, fs = op(q, k, v, g, scale=1.0, output_final_state=True)
        assert o.shape == (B, T, H, dv) and o.dtype == F64
        assert_per_head(o, ref, 1e-9, f"chunk_size={op.chunk_size}")
        outs[cs] = (o, fs)
    assert_states(outs[16][1], outs[64][1], 1e-10, "final state, chunk 16 vs default")
    # the derived serial recurrence on a prefix (the oracle is causal)
    Ts = min(T, 33)
    os_, ss = op.serial(q[:, :Ts], k[:, :Ts], v[:, :Ts], None if g is None else g[:, :Ts], scale=1.0)
    assert os_.shape == (B, Ts, H, dv)
    assert_per_head(os_, ref[:, :Ts], 1e-9, "serial vs oracle")
    assert_rel(outs[16][0][:, :Ts], os_, 1e-10, "chunked vs serial")
    if Ts == T:
        assert_states(outs[16][1], ss, 1e-10, "final state, chunked vs serial")


@pytest.mark.parametrize("name", SPECS)
def test_chunk_sizes_agree_with_serial(name):
    """T = 70 runs two chunks at the default size (64 + 6 padded); odd sizes too."""
    q, k, v, g = make_inputs(1, 70, 2, 3, 4, "random", seed=3)
    os_, ss = make_op(name).serial(q, k, v, g)
    for cs in (64, 24, 8, 1):
        o, s = make_op(name, chunk_size=cs)(q, k, v, g, output_final_state=True)
        assert_rel(o, os_, 1e-10, f"chunk_size={cs} output")
        assert_states(s, ss, 1e-10, f"chunk_size={cs}")


def test_default_scale_is_inverse_sqrt_d():
    q, k, v, g = make_inputs(2, 9, 2, 4, 3, "random", seed=5)
    op = make_op("hla2")
    o_default, _ = op(q, k, v, g)
    o_explicit, _ = op(q * 4 ** -0.5, k, v, g, scale=1.0)
    assert_rel(o_default, o_explicit, 1e-12, "scale=None")
    o_half, _ = op(q, k, v, g, scale=0.5)
    assert_rel(o_half, oracle_all("hla2", {}, 0.5 * q, k, v, g), 1e-9, "scale=0.5")


# ------------------------------------------------------------------ 2. state passing
SPLIT_T = 40
SPLITS = [7, 16, 23, 39]  # chunk_size 16: inside chunk 0, a boundary, inside chunk 1, last token


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=cid)
def test_state_passing(cfg, normalize):
    name, params = cfg
    q, k, v, g = make_inputs(2, SPLIT_T, 2, 3, 4, "random", seed=11)
    op = make_op(name, dict(params, normalize=normalize), 16)
    o_full, s_full = op(q, k, v, g, output_final_state=True)
    for t in SPLITS:
        a, b = slice(0, t), slice(t, None)
        o1, s1 = op(q[:, a], k[:, a], v[:, a], g[:, a], output_final_state=True)
        o2, s2 = op(q[:, b], k[:, b], v[:, b], g[:, b], initial_state=s1, output_final_state=True)
        assert_rel(torch.cat([o1, o2], 1), o_full, 1e-10, f"output split at {t}")
        assert_states(s2, s_full, 1e-10, f"final state split at {t}")
    # three pieces, the middle one run by the serial recurrence
    o1, s1 = op(q[:, :10], k[:, :10], v[:, :10], g[:, :10], output_final_state=True)
    o2, s2 = op.serial(q[:, 10:20], k[:, 10:20], v[:, 10:20], g[:, 10:20], initial_state=s1)
    o3, s3 = op(q[:, 20:], k[:, 20:], v[:, 20:], g[:, 20:], initial_state=s2, output_final_state=True)
    assert_rel(torch.cat([o1, o2, o3], 1), o_full, 1e-10, "chunk/serial/chunk split")
    assert_states(s3, s_full, 1e-10, "chunk/serial/chunk final state")


@pytest.mark.parametrize("name", SPECS)
def test_initial_state_serial_matches_chunked(name):
    """A nonzero (random) initial state gives the same result on both paths."""
    q, k, v, g = make_inputs(2, 21, 2, 3, 4, "random", seed=12)
    op = make_op(name, {"normalize": False}, 16)
    init = random_state(op, 2, 2, 3, 4, seed=13)
    o, s = op(q, k, v, g, initial_state=init, output_final_state=True)
    os_, ss = op.serial(q, k, v, g, initial_state=init)
    assert_rel(o, os_, 1e-10, "output")
    assert_states(s, ss, 1e-10, "final state")


@pytest.mark.parametrize("name", SPECS)
def test_strong_gates(name):
    """Large |g| (Lam down to -720 inside one 32-token chunk: exp(-Lam) would overflow
    even float64) must neither overflow nor lose accuracy, in float64 and float32;
    gradients stay finite."""
    T = 24
    q, k, v, _ = make_inputs(1, T, 1, 3, 4, seed=15)
    for gval in (-2.0, -30.0):
        g = torch.full((1, T, 1), gval, dtype=F64)
        ref = oracle_all(name, {}, q, k, v, g)
        op = make_op(name)
        o64, _ = op(q, k, v, g, scale=1.0)
        assert_rel(o64, ref, 1e-9, f"g={gval} float64")
        leaves = [x.float().requires_grad_(True) for x in (q, k, v, g)]
        o32, s32 = op(*leaves, scale=1.0, output_final_state=True)
        assert_rel(o32, ref, 1e-5, f"g={gval} float32")
        (o32.sum() + sum(x.sum() for x in s32.values())).backward()
        for x, n in zip(leaves, "qkvg"):
            assert bool(torch.isfinite(x.grad).all()), f"g={gval}: non-finite grad of {n}"


def test_noncontiguous_inputs():
    """[B, H, T, d] storage viewed as [B, T, H, d] gives the same result."""
    rng = gen(16)
    x = [torch.randn(2, 2, 19, n, generator=rng, dtype=F64) for n in (3, 3, 4)]
    g = -0.5 * torch.rand(2, 2, 19, generator=rng, dtype=F64)
    views = [t.transpose(1, 2) for t in x] + [g.transpose(1, 2)]
    op = make_op("hla2", {}, 16)
    o1, s1 = op(*views, output_final_state=True)
    o2, s2 = op(*[t.contiguous() for t in views], output_final_state=True)
    assert_rel(o1, o2, 1e-14, "output")
    assert_states(s1, s2, 1e-14, "state")


def test_no_final_state_unless_asked():
    q, k, v, g = make_inputs(1, 5, 1, 3, 3, "random")
    _, s = make_op("hla2")(q, k, v, g)
    assert s is None


# --------------------------------------------------------------------------- 3. varlen
LENGTHS = [7, 20, 33]


@pytest.mark.parametrize("with_init", [False, True], ids=["zero-init", "init"])
@pytest.mark.parametrize("cfg", [("linear", {}), ("hla2", {"normalize": True}), ("ahla", {}),
                                 ("hla3", {}), ("hla3_masked", {"normalize": True}),
                                 ("power", {}), ("power", {"p": 3})], ids=cid)
def test_varlen(cfg, with_init):
    name, params = cfg
    d, dv, H = 3, 4, 2
    T = sum(LENGTHS)
    q, k, v, g = make_inputs(1, T, H, d, dv, "random", seed=21)
    cu = torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)), dtype=torch.int32)
    op = make_op(name, params, 16)
    init = random_state(op, len(LENGTHS), H, d, dv, seed=22, positive=True) if with_init else None
    o, s = op(q, k, v, g, initial_state=init, output_final_state=True, cu_seqlens=cu)
    assert o.shape == (1, T, H, dv)
    assert set(s) == set(op.state_names)
    for name_, x in s.items():
        assert x.shape[0] == len(LENGTHS), name_
    for n in range(len(LENGTHS)):
        a, b = int(cu[n]), int(cu[n + 1])
        o_n, s_n = op(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b],
                      initial_state=None if init is None else row(init, n), output_final_state=True)
        assert_rel(o[:, a:b], o_n, 1e-10, f"sequence {n} output")
        assert_states(row(s, n), s_n, 1e-10, f"sequence {n} state")


def test_varlen_empty_sequences_keep_initial_state():
    op = make_op("hla2", {"normalize": True}, 16)
    q, k, v, g = make_inputs(1, 9, 2, 3, 4, "random", seed=23)
    init = random_state(op, 4, 2, 3, 4, seed=24)
    cu = torch.tensor([0, 0, 5, 5, 9])
    o, s = op(q, k, v, g, initial_state=init, output_final_state=True, cu_seqlens=cu)
    for n, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        if a == b:
            assert_states(row(s, n), row(init, n), 0.0, f"empty sequence {n}")
            continue
        o_n, s_n = op(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], initial_state=row(init, n),
                      output_final_state=True)
        assert_rel(o[:, a:b], o_n, 1e-10, f"sequence {n} output")
        assert_states(row(s, n), s_n, 1e-10, f"sequence {n} state")


def test_varlen_int64_and_single_sequence():
    q, k, v, g = make_inputs(1, 19, 2, 3, 3, "const")
    op = make_op("hla2", {}, 16)
    o, s = op(q, k, v, g, output_final_state=True, cu_seqlens=torch.tensor([0, 19]))
    o_ref, s_ref = op(q, k, v, g, output_final_state=True)
    assert_rel(o, o_ref, 1e-12, "output")
    assert_states(s, s_ref, 1e-12, "state")


# -------------------------------------------------------------------------- 4. gradcheck
def gradcheck_op(name, params, T, d, dv, chunk_size, seed, positive=False, gate=True, cu_seqlens=None):
    op = make_op(name, params, chunk_size)
    rng = gen(seed)
    if positive:  # keeps normalised denominators away from 0
        q = 0.2 + 0.8 * torch.rand(1, T, 1, d, generator=rng, dtype=F64)
        k = 0.2 + 0.8 * torch.rand(1, T, 1, d, generator=rng, dtype=F64)
    else:
        q = torch.randn(1, T, 1, d, generator=rng, dtype=F64) / d ** 0.5
        k = torch.randn(1, T, 1, d, generator=rng, dtype=F64) / d ** 0.5
    v = torch.randn(1, T, 1, dv, generator=rng, dtype=F64)
    g = -0.05 - 0.45 * torch.rand(1, T, 1, generator=rng, dtype=F64)
    n_seq = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    init = random_state(op, n_seq, 1, d, dv, seed + 1, positive=positive)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    names = list(init)
    leaves = [q, k, v] + ([g] if gate else []) + [init[n] for n in names]
    leaves = [x.clone().requires_grad_(True) for x in leaves]

    def f(*xs):
        q_, k_, v_ = xs[:3]
        g_ = xs[3] if gate else None
        st = dict(zip(names, xs[4 if gate else 3:]))
        o, fs = op(q_, k_, v_, g_, scale=1.0, initial_state=st, output_final_state=True, cu_seqlens=cu)
        return (o,) + tuple(fs[n] for n in names)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)


GRAD_CASES = [pytest.param(name, {}, 6, 2 if name in CUBIC else 3, 2, id=name) for name in SPECS] + [
    pytest.param("hla2", {"ridge": 0.3}, 6, 2, 3, id="hla2-ridge"),
    pytest.param("power", {"p": 3}, 6, 2, 2, id="power-p3"),
    # multi-chunk: T = 20 with chunk_size 16
    pytest.param("hla2", {}, 20, 2, 2, id="hla2-T20-multichunk"),
    pytest.param("ahla", {}, 20, 2, 2, id="ahla-T20-multichunk"),
]


@pytest.mark.parametrize("name,params,T,d,dv", GRAD_CASES)
def test_gradcheck(name, params, T, d, dv):
    gradcheck_op(name, dict(params, normalize=False), T, d, dv, 16, seed=31 + T)


@pytest.mark.parametrize("name", ["linear", "ahla"])
def test_gradcheck_normalized(name):
    gradcheck_op(name, {"normalize": True}, 6, 2, 2, 16, seed=41, positive=True)


def test_gradcheck_ungated_multichunk():
    gradcheck_op("linear", {"normalize": False}, 20, 2, 2, 16, seed=43, gate=False)


@pytest.mark.parametrize("name", ["hla2", "ahla"])
def test_gradcheck_varlen(name):
    gradcheck_op(name, {"normalize": False}, 9, 2, 2, 16, seed=45, cu_seqlens=[0, 2, 9])


# ------------------------------------------------------------------------- 5. validation
def base_inputs(B=2, T=5, H=2, d=3, dv=4):
    q, k, v, g = make_inputs(B, T, H, d, dv, "random", seed=51)
    return dict(q=q, k=k, v=v, g=g)


def _replace(**changes):
    return lambda kw: kw.update(changes)


def _with(key, fn):
    return lambda kw: kw.update({key: fn(kw)})


def _varlen(cu, B=1, T=6, raw=False):
    def f(kw):
        kw.update(base_inputs(B=B, T=T))
        kw["cu_seqlens"] = cu if raw or not isinstance(cu, list) else torch.tensor(cu, dtype=torch.int32)
    return f


def _state(edit):
    """initial_state for the base inputs (linear, normalize=True: S [2,2,3,4], z [2,2,3])."""
    def f(kw):
        state = {"S": torch.zeros(2, 2, 3, 4, dtype=F64), "z": torch.zeros(2, 2, 3, dtype=F64)}
        edit(state)
        kw["initial_state"] = state
    return f


META = torch.device("meta")
VALIDATION = [
    # tensors and ndim
    ("q-not-tensor", _replace(q=[[1.0]]), r"^q must be a torch\.Tensor"),
    ("q-ndim", _with("q", lambda kw: kw["q"][0]), r"^q must have 4 dimensions"),
    ("k-ndim", _with("k", lambda kw: kw["k"][..., 0]), r"^k must have 4 dimensions"),
    ("v-ndim", _with("v", lambda kw: kw["v"].unsqueeze(0)), r"^v must have 4 dimensions"),
    # dtypes
    ("q-int", _with("q", lambda kw: kw["q"].to(torch.int64)), r"^q must be float16, bfloat16"),
    ("v-int", _with("v", lambda kw: kw["v"].to(torch.int32)), r"^v must be float16, bfloat16"),
    ("k-dtype", _with("k", lambda kw: kw["k"].float()), r"^k has dtype torch\.float32 but q"),
    ("v-dtype", _with("v", lambda kw: kw["v"].bfloat16()), r"^v has dtype torch\.bfloat16 but q"),
    # shapes
    ("k-T", _with("k", lambda kw: kw["k"][:, :4]), r"^k must have q's \[B, T, H\]"),
    ("v-B", _with("v", lambda kw: kw["v"][:1]), r"^v must have q's \[B, T, H\]"),
    ("v-H", _with("v", lambda kw: kw["v"][:, :, :1]), r"^v must have q's \[B, T, H\]"),
    ("k-d", _with("k", lambda kw: kw["k"][..., :2]), r"^k has last dimension 2 .*'d' = 3"),
    # devices (meta tensors stand in for another device)
    ("k-device", _with("k", lambda kw: kw["k"].to(META)), r"^k is on meta"),
    ("v-device", _with("v", lambda kw: kw["v"].to(META)), r"^v is on meta"),
    ("g-device", _with("g", lambda kw: kw["g"].to(META)), r"^g is on meta"),
    # gates
    ("g-positive", _with("g", lambda kw: kw["g"].index_fill(1, torch.tensor([2]), 0.1)),
     r"^g holds log decays and must be <= 0"),
    ("g-shape", _with("g", lambda kw: kw["g"][:, :4]), r"^g must be a tensor of shape \[B, T, H\]"),
    ("g-ndim", _with("g", lambda kw: kw["g"].unsqueeze(-1)), r"^g must be a tensor of shape"),
    ("g-not-tensor", _replace(g=-0.1), r"^g must be a tensor of shape"),
    ("g-int", _with("g", lambda kw: kw["g"].to(torch.int64)), r"^g must be a floating tensor"),
    ("g-nan", _with("g", lambda kw: kw["g"].index_fill(1, torch.tensor([0]), float("nan"))),
     r"^g must be finite"),
    ("g-inf", _with("g", lambda kw: kw["g"].index_fill(1, torch.tensor([0]), -math.inf)),
     r"^g must be finite"),
    # scale
    ("scale-tensor", _replace(scale=torch.tensor(0.5)), r"^scale must be a finite number"),
    ("scale-str", _replace(scale="0.5"), r"^scale must be a finite number"),
    # cu_seqlens
    ("cu-float", _varlen(torch.tensor([0.0, 6.0])), r"^cu_seqlens must be a 1-D int32/int64"),
    ("cu-2d", _varlen(torch.tensor([[0, 6]])), r"^cu_seqlens must be a 1-D int32/int64"),
    ("cu-list", _varlen([0, 6], raw=True), r"^cu_seqlens must be a 1-D int32/int64"),
    ("cu-batch", _varlen([0, 3, 6], B=2), r"^with cu_seqlens the batch size must be 1, got B = 2"),
    ("cu-short", _varlen([0]), r"^cu_seqlens needs at least two entries"),
    ("cu-start", _varlen([1, 3, 6]), r"^cu_seqlens must start at 0, got 1"),
    ("cu-decreasing", _varlen([0, 4, 2, 6]), r"^cu_seqlens must be non-decreasing"),
    ("cu-end-short", _varlen([0, 3, 5]), r"^cu_seqlens must end at T = 6, got 5"),
    ("cu-end-long", _varlen([0, 3, 7]), r"^cu_seqlens must end at T = 6, got 7"),
    # initial_state
    ("state-not-dict", _replace(initial_state=[torch.zeros(1)]), r"^initial_state must be a dict"),
    ("state-missing", _state(lambda s: s.pop("z")),
     r"^initial_state must have exactly the entries \['S', 'z'\]; missing \['z'\]$"),
    ("state-extra", _state(lambda s: s.update(R=torch.zeros(2, 2, 3, 3, dtype=F64))),
     r"^initial_state must have exactly the entries .*; unexpected \['R'\]$"),
    ("state-missing-and-extra", _state(lambda s: s.update(zz=s.pop("z"))),
     r"missing \['z'\]; unexpected \['zz'\]"),
    ("state-shape", _state(lambda s: s.update(S=s["S"][..., :3])),
     r"^initial_state\['S'\] must have shape \(2, 2, 3, 4\), got \(2, 2, 3, 3\)"),
    ("state-N", _state(lambda s: s.update(z=s["z"][:1])),
     r"^initial_state\['z'\] must have shape \(2, 2, 3\)"),
    ("state-not-tensor", _state(lambda s: s.update(z=0.0)), r"^initial_state\['z'\] must have shape"),
    ("state-bf16", _state(lambda s: s.update(S=s["S"].bfloat16())),
     r"^initial_state\['S'\] must be float32 \(or float64\), got torch\.bfloat16"),
    ("state-int", _state(lambda s: s.update(z=s["z"].long())), r"^initial_state\['z'\] must be float32"),
    ("state-device", _state(lambda s: s.update(S=s["S"].to(META))), r"^initial_state\['S'\] is on meta"),
]


@pytest.mark.parametrize("edit,match", [pytest.param(e, m, id=i) for i, e, m in VALIDATION])
def test_validation(edit, match):
    op = make_op("linear", {"normalize": True})
    kw = base_inputs()
    edit(kw)
    with pytest.raises(ValueError, match=match):
        op(**kw)


def test_validation_varlen_state_count():
    """With cu_seqlens, initial_state needs one entry per sequence, not per batch row."""
    op = make_op("linear")
    kw = base_inputs(B=1, T=6)
    cu = torch.tensor([0, 2, 6])
    bad = {"S": torch.zeros(1, 2, 3, 4, dtype=F64)}
    with pytest.raises(ValueError, match=r"^initial_state\['S'\] must have shape \(2, 2, 3, 4\)"):
        op(**kw, cu_seqlens=cu, initial_state=bad)


@pytest.mark.parametrize("name,params", [("linear", {"foo": 1}), ("hla2", {"p": 2}),
                                         ("power", {"ridge": 0.1}), ("hla3", {"Normalize": True})])
def test_unknown_parameter(name, params):
    with pytest.raises(hladsl.SpecError, match=f"unknown parameter '{next(iter(params))}'"):
        hladsl.load(name, **params)


# ----------------------------------------------------------------------------- 6. dtypes
@pytest.mark.parametrize("cfg", CONFIGS, ids=cid)
def test_low_precision(cfg):
    name, params = cfg
    q, k, v, g = make_inputs(2, 24, 2, 3, 4, "random", seed=61)
    op = make_op(name, params, 16)
    o64, s64 = op(q, k, v, g, output_final_state=True)
    assert all(x.dtype == F64 for x in s64.values())
    # float32: float32 output and state, close to the float64 result
    o32, s32 = op(q.float(), k.float(), v.float(), g.float(), output_final_state=True)
    assert o32.dtype == torch.float32
    assert all(x.dtype == torch.float32 for x in s32.values())
    assert_rel(o32, o64, 1e-5, "float32 output")
    for key in s64:
        assert_rel(s32[key], s64[key], 1e-5, f"float32 state {key}")
    # bfloat16: bfloat16 out, fp32 states; loose check against the float64 result
    lo = [x.to(torch.bfloat16) for x in (q, k, v, g)]
    o_lo, s_lo = op(*lo, output_final_state=True)
    assert o_lo.dtype == torch.bfloat16
    assert all(x.dtype == torch.float32 for x in s_lo.values())
    assert_rel(o_lo, o64, 3e-2, "bfloat16 output")


def test_float16_output_dtype():
    q, k, v, g = make_inputs(1, 20, 2, 3, 4, "random", seed=64)
    op = make_op("hla2", {}, 16)
    o64, _ = op(q, k, v, g)
    o16, s16 = op(q.half(), k.half(), v.half(), g.half(), output_final_state=True)
    assert o16.dtype == torch.float16 and s16["S"].dtype == torch.float32
    assert_rel(o16, o64, 1e-2, "float16 output")


def test_float32_initial_state_with_float64_inputs():
    """fp32 initial state is accepted with fp64 inputs (DESIGN: states are fp32)."""
    q, k, v, g = make_inputs(1, 8, 1, 3, 3, "random", seed=62)
    op = make_op("hla2")
    init = random_state(op, 1, 1, 3, 3, seed=63)
    o64, _ = op(q, k, v, g, initial_state=init)
    o32, _ = op(q, k, v, g, initial_state={n: x.float() for n, x in init.items()})
    assert o32.dtype == F64
    assert_rel(o32, o64, 1e-6, "fp32 initial state")


# ------------------------------------------------------------------------- 7. state dict
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("name", SPECS)
def test_state_keys(name, normalize):
    op = make_op(name, {"normalize": normalize})
    plain, norm = STATES[name]
    want = plain | norm if normalize else plain
    assert set(op.state_names) == want
    assert set(op.state_shapes(3, 4)) == want
    q, k, v, g = make_inputs(2, 5, 2, 3, 4, "random")
    _, s = op(q, k, v, g, output_final_state=True)
    assert set(s) == want
    for key, shape in op.state_shapes(3, 4).items():
        assert tuple(s[key].shape) == (2, 2) + shape, key


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "norm"])
def test_power_state_is_packed(normalize):
    op = make_op("power", {"normalize": normalize})
    want = {"U": (2080, 64)} | ({"z": (2080,)} if normalize else {})
    assert op.state_shapes(64, 64) == want
    q, k, v, g = make_inputs(2, 5, 2, 64, 4, "random", seed=71)
    _, s = op(q, k, v, g, output_final_state=True)
    assert tuple(s["U"].shape) == (2, 2, 2080, 4)
    if normalize:
        assert tuple(s["z"].shape) == (2, 2, 2080)
    for p, d in ((3, 8), (4, 4)):  # C(d + p - 1, p) rows
        assert make_op("power", {"p": p}).state_shapes(d, 5)["U"] == (math.comb(d + p - 1, p), 5)


@pytest.mark.parametrize("name,keys", [("hla2", ["S"]), ("hla3", ["SK", "SQ"]), ("hla3_masked", ["S"])])
def test_symmetric_states_are_packed(name, keys):
    d, dv = 5, 2
    op = make_op(name)
    shapes = op.state_shapes(d, dv)
    q, k, v, _ = make_inputs(2, 7, 3, d, dv, seed=72)
    _, s = op(q, k, v, scale=1.0, output_final_state=True)
    pairs = list(combinations_with_replacement(range(d), 2))
    for key in keys:
        assert shapes[key] == (d * (d + 1) // 2,)
        assert tuple(s[key].shape) == (2, 3, d * (d + 1) // 2)
        # without gates: sum over tokens of x x^T, stored as its entries i <= j (row-major)
        x = q if key == "SQ" else k
        full = torch.einsum("btha,bthc->bhac", x, x)
        packed = torch.stack([full[..., i, j] for i, j in pairs], -1)
        assert_rel(s[key], packed, 1e-12, f"packed {key}")


def test_linear_state_value():
    """Final linear state with decay = sum_j exp(L_T - L_j) k_j v_j^T."""
    q, k, v, g = make_inputs(2, 30, 2, 3, 4, "random", seed=73)
    _, s = make_op("linear", {}, 16)(q, k, v, g, output_final_state=True)
    lam = g.cumsum(1)
    w = torch.exp(lam[:, -1:] - lam)
    want = torch.einsum("bth,btha,bthe->bhae", w, k, v)
    assert_rel(s["S"], want, 1e-12, "S")


# validation of op.serial: the same ValueErrors as the op (it has no cu_seqlens).
# Kept last so that under -x the whole file runs before a failure here.
@pytest.mark.parametrize("edit,match", [pytest.param(e, m, id=i) for i, e, m in VALIDATION
                                        if not i.startswith("cu-")])
def test_validation_serial(edit, match):
    op = make_op("linear", {"normalize": True})
    kw = base_inputs()
    edit(kw)
    with pytest.raises(ValueError, match=match):
        op.serial(**kw)


def test_torch_func_grad_and_vjp_equal_autograd():
    """Under torch.func's transforms the op runs through an autograd.Function with
    setup_context (eager calls use one without: cheaper), with the same gradients."""
    op = hladsl.load("hla2", backend="torch")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 40, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -torch.rand(1, 40, 2, generator=gen, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    o, _ = op(*leaves[:3], g=leaves[3])
    want = torch.autograd.grad(o.square().sum(), leaves)
    got = torch.func.grad(lambda *xs: op(*xs[:3], g=xs[3])[0].square().sum(), argnums=(0, 1, 2, 3))(q, k, v, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    out, pull = torch.func.vjp(lambda q: op(q, k, v, g=g)[0], q)
    torch.testing.assert_close(pull(torch.ones_like(out))[0],
                               torch.autograd.grad(op(leaves[0], k, v, g=g)[0].sum(), leaves[0])[0],
                               rtol=1e-12, atol=1e-12)
