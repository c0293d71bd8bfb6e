"""Bound forward calls (runtime.binding, op._BoundForward): a call like an earlier one in
all but its data replays that call's launches and equals the validated path bitwise.
Direct launches need a GPU; here ``direct.bind`` re-launches through the interpreter with
the call's tensors in the bound slots (conftest's ``interpreter_binds``) -- the slots, roles
and buffers are binding's."""
import os

import pytest
import torch

import hladsl
from hladsl.runtime import binding, launch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="generated kernels on CPU need TRITON_INTERPRET=1")


def _calls(op, B, T, H, d, dv, gated, with_init, n, seed=3):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        q, k, v = (0.5 * torch.randn(B, T, H, m, generator=gen) for m in (d, d, dv))
        kw = {"output_final_state": True}
        if gated:
            kw["g"] = -0.3 * torch.rand(B, T, H, generator=gen)
        if with_init:
            kw["initial_state"] = {name: 0.2 * torch.randn((B, H) + shape, generator=gen)
                                   for name, shape in op.state_shapes(d, dv).items()}
        out.append(((q, k, v), kw))
    return out


@pytest.mark.parametrize("spec, gated, with_init, B, H", [
    ("linear", False, False, 2, 2), ("linear", True, True, 2, 2), ("hla2", True, False, 2, 2),
    ("ahla", False, True, 2, 2), ("power", True, False, 2, 2), ("hla3_masked", False, False, 2, 2),
    ("linear", False, False, 1, 1), ("hla2", True, False, 1, 1)])   # size-1 dims: any strides
def test_a_bound_call_equals_the_validated_call(spec, gated, with_init, B, H, interpreter_binds):
    op = hladsl.load(spec, backend="triton", chunk_size=16, **({"p": 2} if spec == "power" else {}))
    calls = _calls(op, B, 32, H, 8, 8, gated, with_init, n=3)
    (q, _, v), kw = calls[0]
    calls.append(((q, q, v), kw))   # aliased inputs where the recorded call had distinct ones
    with launch.switched(BOUND_CALLS=False):
        want = [op(*xs, **kw) for xs, kw in calls]
    with torch.no_grad():
        got = [op(*xs, **kw) for xs, kw in calls]
    third = len(interpreter_binds) // 3          # the second to fourth calls were bound, alike
    assert third >= 2 and interpreter_binds == interpreter_binds[:third] * 3
    for (o, finals), (o_want, finals_want) in zip(got, want):
        assert torch.equal(o, o_want)
        assert finals.keys() == finals_want.keys()
        for name in finals:
            assert torch.equal(finals[name], finals_want[name]), name
    # a bound call keeps none of the recorded call's tensors, and its outputs are new buffers
    assert got[1][0].data_ptr() != got[2][0].data_ptr()


def test_a_first_call_counting_its_compiles_is_bound(interpreter_binds, monkeypatch):
    """On a GPU a shape class's first call runs a dry run first (runtime.progress counts the
    variants it will compile): its launches launch nothing and must not leave the recorded
    call unbound (the interpreter is quiet; here progress is not)."""
    from hladsl.runtime import progress
    monkeypatch.setattr(progress, "quiet", lambda: False)
    monkeypatch.setattr(progress, "_PLANNED", set())
    op = hladsl.load("linear", backend="triton", chunk_size=16)
    (xs, kw), = _calls(op, 1, 48, 1, 8, 8, True, False, n=1)
    with launch.switched(BOUND_CALLS=True):
        dry = []
        real_record = progress.record
        monkeypatch.setattr(progress, "record", lambda kernel, args: (dry.append(kernel), real_record(kernel, args)))
        want = op(*xs, **kw)
        got = op(*xs, **kw)
    assert dry and len(interpreter_binds) == 2
    assert torch.equal(got[0], want[0]) and torch.equal(got[1]["S"], want[1]["S"])


def test_calls_that_cannot_be_replayed_validate_every_time(interpreter_binds):
    """Padded tokens (T not a multiple of the chunk), an initial state the kernels read in
    another layout (HLA2's packed symmetric S, unpacked for them), another form of the
    call, one tensor passed as two inputs: never bound."""
    op = hladsl.load("hla2", backend="triton", chunk_size=16)
    with launch.switched(BOUND_CALLS=True):   # (a switch forgets the calls bound before)
        for T, with_init in ((20, False), (32, True)):
            for xs, kw in _calls(op, 1, T, 2, 8, 8, True, with_init, n=2):
                op(*xs, **kw)
        q, k, v = (torch.randn(1, 32, 2, 8) for _ in range(3))
        for _ in range(2):
            op(q, k, v, None)          # g positionally: not the usual form
        with torch.no_grad():
            for _ in range(2):
                op(q, q, v)            # one tensor as two inputs: which one a kernel read is ambiguous
    assert interpreter_binds == []
    assert not binding.active()


def test_a_launch_rule_switch_forgets_bound_calls(interpreter_binds):
    op = hladsl.load("linear", backend="triton", chunk_size=16)
    (xs, kw), = _calls(op, 1, 32, 2, 8, 8, False, False, n=1)
    with launch.switched(BOUND_CALLS=True):
        op(*xs, **kw)
        op(*xs, **kw)
    assert len(interpreter_binds) == 2
    with launch.switched(BOUND_CALLS=True):   # a switch, even to the same value, starts over
        op(*xs, **kw)
    assert len(interpreter_binds) == 2


def test_what_a_bound_call_keys_on_besides_shapes(interpreter_binds):
    """The op's chunk size, the scale's type and an initial state's entries are part of the
    key: changing the chunk validates (and binds) anew, and a scale of True or an initial
    state with an extra entry still get validation's errors after the call was bound."""
    op = hladsl.load("linear", backend="triton", chunk_size=16)
    calls = _calls(op, 1, 32, 2, 8, 8, False, True, n=2)
    with launch.switched(BOUND_CALLS=True):
        for xs, kw in calls:
            op(*xs, **kw)
        bound = len(interpreter_binds)
        assert bound == 2
        (xs, kw) = calls[0]
        with pytest.raises(ValueError, match="scale"):
            op(*xs, **kw, scale=True)
        op(*xs, **kw, scale=1.0)
        extra = {**kw["initial_state"], "T": kw["initial_state"]["S"]}
        with pytest.raises(ValueError, match="initial_state"):
            op(*xs, **{**kw, "initial_state": extra})
        try:
            op.chunk_size = 32
            got = op(*xs, **kw)
            assert len(interpreter_binds) == bound      # validated: a new key
            with launch.switched(BOUND_CALLS=False):
                want = op(*xs, **kw)
        finally:
            op.chunk_size = 16
    assert torch.equal(got[0], want[0]) and torch.equal(got[1]["S"], want[1]["S"])


def test_a_first_call_whose_launch_raised_binds_later(interpreter_binds, monkeypatch):
    """OutOfResources in a recorded call's launch (the chunk then halved and remembered by
    the launch layer) spoils that recording only: a later call records again and binds."""
    from triton.runtime.errors import OutOfResources
    real = launch._launch_variant
    raised = []

    def once(kernel, grid, args, may_fall_back, tiling):
        if not raised:
            raised.append(kernel)
            raise OutOfResources(1, 0, "shared memory (test)")
        return real(kernel, grid, args, may_fall_back, tiling)
    monkeypatch.setattr(launch, "_launch_variant", once)
    op = hladsl.load("hla2", backend="triton")           # chunk 32 on CPU at T = 32, then 16
    calls = _calls(op, 1, 32, 2, 8, 8, True, False, n=3, seed=9)
    with launch.switched(BOUND_CALLS=True):
        got = [op(*xs, **kw) for xs, kw in calls]
    with launch.switched(BOUND_CALLS=False):
        want = [op(*xs, **kw) for xs, kw in calls]
    assert raised and interpreter_binds                  # the third call was bound
    for (o, finals), (o_want, finals_want) in zip(got, want):
        assert torch.equal(o, o_want)
        assert all(torch.equal(finals[n], finals_want[n]) for n in finals_want)


def test_a_dry_run_registers_nothing():
    """progress.counted's dry run allocates a call's buffers and drops them: a recording
    must not hold them (it would double a first call's memory)."""
    from hladsl.runtime import progress
    with binding.recording([]) as rec:
        token = progress._dry.set([])
        try:
            binding.fresh(torch.empty(4))
            binding.derived("lam", torch.empty(4))
        finally:
            progress._dry.reset(token)
        binding.fresh(torch.empty(4))
    assert len(rec.fresh) == 1 and not rec.derived


def test_bound_keys_hold_the_direct_switch(monkeypatch):
    """Bound launches are direct: turning direct launches off gives every bound path (the
    forward's and the decode step's) a new key, so their calls validate and launch through
    ``kernel[grid]`` as asked."""
    from hladsl.runtime import direct
    from hladsl.runtime.op import _call_signature, _step_signature
    op = hladsl.load("linear", backend="triton", chunk_size=16)
    (xs, kw), = _calls(op, 1, 32, 2, 8, 8, True, True, n=1)
    state = kw["initial_state"]
    with torch.no_grad():
        keys = [(_call_signature(op, xs, kw), _step_signature(op, xs, {"state": state}))]
        monkeypatch.setattr(direct, "ENABLED", not direct.ENABLED)
        keys.append((_call_signature(op, xs, kw), _step_signature(op, xs, {"state": state})))
    assert None not in keys[0] and keys[0][0] != keys[1][0] and keys[0][1] != keys[1][1]


def _training_steps(op, gated, n, T=32, seed=5):
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(n):
        q, k, v = (0.5 * torch.randn(2, T, 2, 8, generator=gen) for _ in range(3))
        g = -0.3 * torch.rand(2, T, 2, generator=gen) if gated else None
        steps.append((q, k, v, g, torch.randn(2, T, 2, 8, generator=gen)))
    return steps


def _train(op, q, k, v, g, do, **kw):
    """One fwd + bwd from the cotangent ``do``: (o, the gradients of q, k, v and g)."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g) if x is not None]
    o, _ = op(*leaves[:3], g=leaves[3] if g is not None else None, **kw)
    o.backward(do)
    return o.detach(), [x.grad for x in leaves]


def _name(kernel) -> str:
    return getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "")


@pytest.mark.parametrize("spec, gated", [("linear", False), ("linear", True), ("hla2", True), ("ahla", False),
                                         ("hla3_masked", False), ("power", True)])
def test_a_bound_training_call_equals_the_validated_call(spec, gated, interpreter_binds):
    """An autograd call like an earlier one in all but its data replays that call's launches,
    its forward (with the state pass it keeps for the backward) and its backward (from a
    cotangent): o and every gradient equal the validated calls' bitwise."""
    op = hladsl.load(spec, backend="triton", chunk_size=16, **({"p": 2} if spec == "power" else {}))
    steps = _training_steps(op, gated, n=3)
    with launch.switched(BOUND_CALLS=False):
        want = [_train(op, *step) for step in steps]
    assert interpreter_binds == []
    with launch.switched(BOUND_CALLS=True):
        got = [_train(op, *step) for step in steps]
    half = len(interpreter_binds) // 2   # the second and third calls were bound, alike
    assert half and interpreter_binds == interpreter_binds[:half] * 2
    names = [_name(k) for k in interpreter_binds[:half]]
    assert "output_kernel" in names and "grad_kernel" in names, names   # forward and backward
    for (o, grads), (o_want, grads_want) in zip(got, want):
        assert torch.equal(o, o_want)
        assert len(grads) == len(grads_want) == 3 + gated
        for a, b in zip(grads, grads_want):
            assert torch.equal(a, b)
    # a replay's gradients are its own buffers
    assert got[1][1][0].data_ptr() != got[2][1][0].data_ptr()


def test_training_calls_that_cannot_be_replayed_validate_every_time(interpreter_binds):
    """A backward with a final state's gradient, or from a cotangent the kernels cannot read
    in place (a sum's, stride 0: copied), and a forward with an initial state: their
    launches are never replayed (the forward of the first two may be)."""
    op = hladsl.load("linear", backend="triton", chunk_size=16)
    with launch.switched(BOUND_CALLS=True):
        for q, k, v, g, do in _training_steps(op, True, n=2):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            o, finals = op(*leaves, g=g, output_final_state=True)
            (o * do).sum().add(finals["S"].sum()).backward()   # a final state's gradient
            op(*leaves, g=g)[0].sum().backward()               # a stride-0 cotangent
        assert "output_kernel" in {_name(k) for k in interpreter_binds}
        assert not {"reverse_kernel", "grad_kernel"} & {_name(k) for k in interpreter_binds}
        interpreter_binds.clear()
        for q, k, v, g, do in _training_steps(op, True, n=2):
            init = {"S": torch.randn(2, 2, 8, 8)}
            _train(op, q, k, v, g, do, initial_state=init)
    assert interpreter_binds == []
    assert not binding.active()


def test_a_replay_allocates_each_buffer_for_its_launches_only():
    """BoundCall.run allocates a fresh buffer just before its first launch and drops it after
    its last unless kept (the caller's outputs): a replay holds no more at once than the
    validated call, which frees its temporaries as it goes."""
    import weakref

    seen = []

    class Launch:
        def launch(self, values):
            seen.append([weakref.ref(x) for x in values])
            alive.append([r() is not None for r in (seen[0][0],)])

    alive = []
    layout = ((4,), (1,), torch.float32, torch.device("cpu"))
    call = binding.BoundCall([(Launch(), [("fresh", 1), ("fresh", 2)]), (Launch(), [("fresh", 2)]),
                              (Launch(), [("fresh", 3)])], {1: layout, 2: layout, 3: layout})
    out = call.run([], {}, keep={3})
    assert set(out) == {3} and out[3].shape == (4,)
    assert alive == [[True], [False], [False]]   # buffer 1 dropped after its only launch
    assert seen[2][0]() is out[3]
    assert set(call.run([], {}, keep={1, 2, 3})) == {1, 2, 3}


def test_a_fit_change_records_training_calls_again(interpreter_binds):
    """A launch that settles on less than planned (a halved chunk, a reverse pass that walks)
    changes what the forward of a training call keeps: the calls bound before it are not
    replayed, the next is recorded again and later ones replay that."""
    op = hladsl.load("linear", backend="triton", chunk_size=16)
    steps = _training_steps(op, False, n=4)
    with launch.switched(BOUND_CALLS=True):
        _train(op, *steps[0])
        _train(op, *steps[1])
        replayed = len(interpreter_binds)
        assert replayed
        launch.fit_changed()
        _train(op, *steps[2])
        assert len(interpreter_binds) == replayed   # recorded again, not replayed
        _train(op, *steps[3])
        assert len(interpreter_binds) == 2 * replayed


def test_a_grouped_gated_scan_is_bound(interpreter_binds):
    """A long gated sequence on few (sequence, head) pairs runs its scans in groups, whose
    group decays a torch op makes from Λ: a bound call derives them too (GROUP_GATES), and
    the replays equal the validated calls bitwise."""
    from hladsl.runtime import triton_backward
    op = hladsl.load("linear", backend="triton", chunk_size=16)
    op.schedule = "scan"
    gen = torch.Generator().manual_seed(7)
    steps = [tuple(0.5 * torch.randn(1, 1024, 2, 8, generator=gen) for _ in range(3))
             + (-0.3 * torch.rand(1, 1024, 2, generator=gen), torch.randn(1, 1024, 2, 8, generator=gen))
             for _ in range(2)]   # the first call is recorded, the second replayed
    with launch.switched(BOUND_CALLS=False):
        want = [_train(op, *step) for step in steps]
    with launch.switched(BOUND_CALLS=True):
        got = [_train(op, *step) for step in steps]
        assert any(p.scan_groups > 1 for p in triton_backward._PLANS.values())
        kinds = {type(b).__name__ for b in op._bound_calls.values()}
    assert {"_BoundTrainingForward", "_BoundTrainingBackward"} <= kinds, kinds
    assert interpreter_binds
    for (o, grads), (o_want, grads_want) in zip(got, want):
        assert torch.equal(o, o_want)
        for a, b in zip(grads, grads_want):
            assert torch.equal(a, b)
