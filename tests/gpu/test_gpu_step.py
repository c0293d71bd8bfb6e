"""Decode on CUDA: ``o, state = op.step(*tokens, g=None, scale=None, state=None)`` (the
serial update as one generated kernel, state updated in place; DESIGN sections 5-6).

* fed one token at a time, and in blocks of several tokens, op.step equals the fp32
  torch reference and the chunked op on the same bf16 values, final state included;
  the state it returns is the caller's dict, updated in place (same storage);
  state=None starts from zeros;
* one decode step captured in a CUDA graph and replayed token after token equals the
  eager steps bitwise (the step must not sync with the host or allocate state); the
  eager steps, the first included, gated or not, never sync (torch's sync debug mode
  set to "error");
* the bridged and the shared split of value-free states agree (hla2, hla3).

Every spec, gated and not, bf16, B = 2, H = 3. These tests skip, saying why, only while
the op has no ``step`` attribute (it lands on its own branch).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from gpu_support import (SPECS, TOL, Ratios, dtype_name, gates, generator, group, initial_state,
                         load, tokens)

# T_STEP pads to 16 chunks, so the chunked op runs the kernels test_gpu_numerics
# compiled (Triton specialises n_chunks == 1 and n_chunks % 16 apart)
B, H, T_STEP = 2, 3, 1000
BLOCK = 13          # several tokens per call: 13, 13, ..., 12
GRAPH_STEPS = 6
BF16 = torch.bfloat16


def op_with_step(spec):
    return load(spec)


def cases():
    for spec in SPECS:
        for gated in (False, True):
            # with test_gpu_numerics' PLAIN / GATED kernels (the chunked op) and the
            # Mixer's decode (the same step kernels): one worker compiles them
            marks = [group(spec.id, spec.d, dtype_name(BF16), gated, False, "two_pass")]
            yield pytest.param(spec, gated, marks=marks,
                               id=f"{spec.id}-{'gated' if gated else 'ungated'}")


def clone(state: dict) -> dict:
    return {n: x.clone() for n, x in state.items()}


def problem(spec, gated, T, seed):
    gen = generator(seed)
    d = spec.d
    toks = tokens(spec, B, T, H, d, d, BF16, False, gen)
    g = gates(B, T, H, gen) if gated else None
    init = initial_state(spec, False, B, H, d, d, gated, gen)
    return toks, g, init


def piece(toks: dict, g, a: int, b: int):
    return [x[:, a:b] for x in toks.values()], (None if g is None else g[:, a:b])


def decode(op, toks, g, state, size):
    """op.step over the tokens in pieces of ``size``; checks the in-place contract."""
    T = next(iter(toks.values())).shape[1]
    storage = {n: x.data_ptr() for n, x in state.items()}
    outs = []
    for a in range(0, T, size):
        xs, gs = piece(toks, g, a, min(a + size, T))
        o, returned = op.step(*xs, g=gs, state=state)
        assert returned is state, "op.step must return the state dict it was given"
        outs.append(o)
    for n, x in state.items():
        assert x.data_ptr() == storage[n], f"state[{n}] was replaced, not updated in place"
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("spec,gated", list(cases()))
def test_step_matches_reference_and_chunked_op(spec, gated, record_property):
    op, ref = op_with_step(spec), load(spec, "torch")
    toks, g, init = problem(spec, gated, T_STEP, seed=41)
    with torch.no_grad():
        o_ref, state_ref = ref(*(x.float() for x in toks.values()), g=g,
                               initial_state=clone(init), output_final_state=True)
        o_op, _ = op(*toks.values(), g=g, initial_state=clone(init))
        ratios = Ratios(record_property)
        for size in (1, BLOCK):
            state = clone(init)
            o = decode(op, toks, g, state, size)
            assert o.dtype == BF16 and o.shape == o_ref.shape
            ratios.add(f"o_step{size}", o_ref, o, TOL[BF16])
            ratios.add(f"o_step{size}_vs_op", o_op, o, TOL[BF16])
            ratios.states(f"state_step{size}", state_ref, state, TOL[BF16])

        # state=None: a zero state, returned
        xs, gs = piece(toks, g, 0, 1)
        o_first, fresh = op.step(*xs, g=gs)
        o_first_ref, fresh_ref = ref(*(x.float() for x in xs), g=gs, output_final_state=True)
        ratios.add("o_first_token_from_zero", o_first_ref, o_first, TOL[BF16])
        ratios.states("state_from_zero", fresh_ref, fresh, TOL[BF16])
    ratios.check()


@contextlib.contextmanager
def no_host_sync():
    """torch raises on any operation that waits for the GPU (reading a value on the host)."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


@pytest.mark.parametrize("spec,gated", list(cases()))
def test_decode_step_replays_from_a_cuda_graph(spec, gated):
    op = op_with_step(spec)
    toks, g, init = problem(spec, gated, GRAPH_STEPS, seed=42)
    with torch.no_grad():
        eager_state = clone(init)
        eager = []
        for t in range(GRAPH_STEPS):   # contiguous, as the static inputs below
            xs, gs = piece(toks, g, t, t + 1)
            xs = [x.contiguous() for x in xs]
            gs = None if gs is None else gs.contiguous()
            # eager too, the first step included (it compiles and copies packed dims' slot
            # tables to the device): a sync would stall a decode loop's launch queue
            with no_host_sync():
                eager.append(op.step(*xs, g=gs, state=eager_state)[0])

        # static inputs and a state that the graph updates in place
        static = [x[:, :1].clone() for x in toks.values()]
        static_g = None if g is None else g[:, :1].clone()
        state = clone(init)
        side = torch.cuda.Stream()          # warm up off the capture stream (torch's recipe)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm = clone(init)
            for _ in range(2):
                op.step(*static, g=static_g, state=warm)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_o, _ = op.step(*static, g=static_g, state=state)

        replayed = []
        for t in range(GRAPH_STEPS):
            xs, gs = piece(toks, g, t, t + 1)
            for dst, src in zip(static, xs):
                dst.copy_(src)
            if g is not None:
                static_g.copy_(gs)
            graph.replay()
            replayed.append(static_o.clone())
        torch.cuda.synchronize()
    for t in range(GRAPH_STEPS):
        assert torch.equal(replayed[t], eager[t]), f"graph replay differs from eager at token {t}"
    for n in init:
        assert torch.equal(state[n], eager_state[n]), f"state[{n}] after replays differs from eager"


@pytest.mark.parametrize("spec,gated", [c for c in cases() if c.values[0].id in ("linear", "hla2")])
def test_bound_decode_calls_equal_validated_ones(spec, gated):
    """op.step in the usual form (tokens positionally, state= by keyword) launches a
    bound kernel once a call of the same signature has run; it must equal the validated
    path (backend= given) bitwise, token after token, on sliced (unaligned) inputs too,
    and a call of another signature (dtype, alignment, shape) must not take it."""
    op = op_with_step(spec)
    toks, g, init = problem(spec, gated, GRAPH_STEPS, seed=43)
    with torch.no_grad():
        bound_state, checked_state = clone(init), clone(init)
        for t in range(GRAPH_STEPS):   # slices of one buffer: their alignment varies with t
            xs, gs = piece(toks, g, t, t + 1)
            o_bound, returned = op.step(*xs, g=gs, state=bound_state)
            o_checked, _ = op.step(*xs, g=gs, state=checked_state, backend="triton")
            assert returned is bound_state and torch.equal(o_bound, o_checked), t
        for n in init:
            assert torch.equal(bound_state[n], checked_state[n]), n
        assert op._bound_steps, "no decode call was bound"
        # another dtype: a new signature, validated and bound apart (not the bf16 launch)
        xs, gs = piece(toks, g, 0, 1)
        o_half, _ = op.step(*(x.half() for x in xs), g=gs, state=clone(init))
        o_ref, _ = op.step(*(x.half() for x in xs), g=gs, state=clone(init), backend="triton")
        assert o_half.dtype == torch.float16 and torch.equal(o_half, o_ref)


@pytest.mark.parametrize("spec,gated", [c for c in cases() if c.values[0].id in ("hla2", "hla3")
                                        and c.values[1]])
def test_shared_split_equals_bridged(spec, gated):
    """The two ways of splitting value blocks where some states lack the value dim -- the
    bridged split (free_kernel, then value_kernel reading its bridges; the default) and
    the shared split (one launch, the last block of a (row, head) updating them), which
    runs where the bridged one does not apply -- give the same outputs and states from
    one state, token after token (fp32 states: only the order of fp32 sums differs)."""
    from hladsl.runtime import launch
    op = op_with_step(spec)
    toks, g, init = problem(spec, gated, BLOCK, seed=44)
    states, outs = {}, {}
    for bridged in (True, False):
        with launch.switched(STEP_BRIDGED=bridged):
            states[bridged] = clone(init)
            outs[bridged] = decode(op, toks, g, states[bridged], 1).float()
    scale = outs[True].abs().max()
    assert (outs[True] - outs[False]).abs().max() <= 2 ** -7 * scale   # bf16 outputs: two ulps at most
    for n in init:
        ref = states[True][n]
        assert (ref - states[False][n]).abs().max() <= 1e-5 * ref.abs().max(), n
