"""Optional autotuning (runtime.autotune, the candidates of runtime.launch) and the
progress lines of slow compiles (runtime.progress), on CPU: fake kernels and a fake
timer for selection, persistence and safety; the generated kernels tuned under the
interpreter against the float64 oracle."""
import json
import time
from types import SimpleNamespace

import pytest
import torch
from oracles import oracle
from triton.runtime.errors import OutOfResources

import hladsl
from hladsl.runtime import autotune, launch, progress

SHAPE = {"gpu": "Fake GPU", "dims": [["d", 16]], "dtype": "torch.float32", "gated": False,
         "bh": 8, "t": 128}


def _fn(name):
    def fn():
        pass
    fn.__module__ = "hladsl_generated_fake_fwd_" + "0" * 24
    fn.__name__ = name
    return fn


class FakeKernel:
    """``kernel[grid](**args)`` as Triton's: ``body(grid, args)`` runs; the first
    launch of each variant sleeps ``compile_s`` (the compile); ``fails(args)`` ->
    OutOfResources."""

    def __init__(self, name="fake_kernel", body=None, fails=None, compile_s=0.0):
        self.fn = _fn(name)
        self.params = [SimpleNamespace(name=n, is_constexpr=True) for n in ("C", "B_v", "DOT")]
        self.body, self.fails, self.compile_s = body, fails, compile_s
        self.launches, self.compiled = [], set()

    def __getitem__(self, grid):
        def run(**args):
            if self.fails is not None and self.fails(args):
                raise OutOfResources(300000, 232448, "shared memory")
            variant = tuple(args.get(n) for n in ("C", "B_v", "num_warps", "num_stages", "maxnreg"))
            if variant not in self.compiled:
                time.sleep(self.compile_s)
                self.compiled.add(variant)
            self.launches.append((grid, args))
            if self.body is not None:
                self.body(grid, args)
        return run


class CostTuner(autotune.Tuner):
    """A Tuner whose clock is ``cost(candidate)``; ``timed`` lists what it timed."""

    def __init__(self, path, cost):
        super().__init__(path)
        self.cost, self.timed = cost, []

    def measure(self, candidate, fn):
        self.timed.append(candidate)
        return self.cost(candidate)


def _never(candidate):
    raise AssertionError(f"timed {candidate} although a winner was stored")


def _tiling():
    """Widths 16 or 32 of a value dim of 64: the grid's second axis follows."""
    return launch.Tiling({"B_v": (16, 32)},
                         lambda w: ((2, 64 // w.get("B_v", 32)), {"B_v": w.get("B_v", 32)}))


def test_tuner_keeps_the_fastest_candidate_that_runs_and_persists_it(tmp_path):
    path = tmp_path / autotune.FILE_NAME
    out = torch.zeros(4)
    kernel = FakeKernel(fails=lambda a: a["num_stages"] == 3)   # stages 3: out of shared memory

    def cost(c):   # fastest: 8 warps, 3 stages (fails), then 2 stages; narrow blocks
        return 10 - c["num_warps"] - c["num_stages"] + c["B_v"] / 16
    tuner = CostTuner(path, cost)
    with autotune.tuning(tuner, SHAPE):
        launch.launch(kernel, (2, 2), {"out": out, "C": 16, "B_v": 32, "DOT": "fp32", "num_warps": 4},
                      True, _tiling())
    assert len(tuner.timed) == 2 * 2 * 2   # widths x warps x stages 1-2 (stages 3 skipped)
    grid, args = kernel.launches[-1]
    assert (grid, args["B_v"], args["num_warps"], args["num_stages"]) == ((2, 4), 16, 8, 2)
    assert args["out"] is out   # the winner runs on the caller's tensor ...
    assert all(a["out"] is not out for _, a in kernel.launches[:-1])   # ... trials on copies

    entries = json.loads(path.read_text())["entries"]
    (key, winner), = entries.items()
    assert winner == {"B_v": 16, "num_warps": 8, "num_stages": 2}
    key = json.loads(key)
    assert key["kernel"] == "hladsl_generated_fake_fwd_" + "0" * 24 + ".fake_kernel"
    assert key["constexprs"] == {"C": "16"}   # what the tuner chooses is not part of the key
    assert {k: key[k] for k in SHAPE} == json.loads(json.dumps(SHAPE))

    # a fresh tuner (a new process) reads the winner and launches it without timing
    again = FakeKernel()
    with autotune.tuning(CostTuner(path, _never), SHAPE):
        launch.launch(again, (2, 2), {"out": out, "C": 16, "B_v": 32, "DOT": "fp32", "num_warps": 4},
                      True, _tiling())
    assert len(again.launches) == 1 and again.launches[0][0] == (2, 4)
    assert {k: again.launches[0][1][k] for k in winner} == winner

    # another shape class (B*H bucket) or other constexprs: tuned anew
    for shape, c in (({**SHAPE, "bh": 16}, 16), (SHAPE, 32)):
        other = CostTuner(path, cost)
        with autotune.tuning(other, shape):
            launch.launch(FakeKernel(), (2, 2), {"out": out, "C": c, "B_v": 32, "num_warps": 4},
                          True, _tiling())
        assert other.timed
    assert len(json.loads(path.read_text())["entries"]) == 3


def test_no_candidate_runs_raises_out_of_resources(tmp_path):
    kernel = FakeKernel(fails=lambda a: True)
    with autotune.tuning(CostTuner(tmp_path / "t.json", lambda c: 1.0), SHAPE), \
            pytest.raises(OutOfResources):
        launch.launch(kernel, (1,), {"C": 16}, True)
    assert not (tmp_path / "t.json").exists()


def test_tuning_never_touches_the_callers_buffers(tmp_path):
    """A kernel accumulating into its output runs once on the caller's tensors, however
    many candidates were timed (on copies, aliasing kept)."""
    acc = torch.zeros(6)

    def body(grid, args):
        args["acc"].add_(1.0)
        args["tail"].add_(10.0)   # a view of acc
    kernel = FakeKernel(body=body)
    tuner = CostTuner(tmp_path / "t.json", lambda c: c["num_stages"])
    with autotune.tuning(tuner, SHAPE):
        launch.launch(kernel, (1,), {"acc": acc, "tail": acc[2:], "C": 16}, True)
    assert len(kernel.launches) > 6
    assert acc.tolist() == [1.0, 1.0, 11.0, 11.0, 11.0, 11.0]

    x = torch.arange(12.0).reshape(3, 4)
    copies = autotune.scratch_copies({"x": x.t(), "row": x[1], "n": 3})
    assert set(copies) == {"x", "row"}
    assert copies["x"].stride() == x.t().stride() and torch.equal(copies["x"], x.t())
    assert copies["x"].data_ptr() != x.data_ptr()
    assert copies["row"].untyped_storage().data_ptr() == copies["x"].untyped_storage().data_ptr()


def test_no_autotuning_on_cpu_or_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("HLADSL_AUTOTUNE", "1")
    assert autotune.requested(False)
    assert not autotune.available(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not autotune.available(torch.device("cuda"))
    x = torch.zeros(1, 4, 1, 16)
    with autotune.session(True, x, {"d": 16}, False) as s:
        assert s is None and autotune.current() is None

    def no_tuner(path):
        raise AssertionError("a tuner was made on CPU")
    monkeypatch.setattr(autotune, "tuner_for", no_tuner)
    op = hladsl.load("linear", backend="triton", chunk_size=16)
    monkeypatch.setattr(op, "autotune", True)    # the op is shared (hladsl.load caches it)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 20, 2, 16, generator=gen) for _ in range(3))
    o, _ = op(q, k, v, scale=1.0)
    want = _oracle_heads("linear", q, k, v, None)
    torch.testing.assert_close(o.double(), want, rtol=1e-4, atol=1e-4)


def _oracle_heads(name, q, k, v, g):
    """The float64 oracle over [B, T, H, ·] inputs."""
    B, _, H, _ = q.shape
    return torch.stack([torch.stack([
        oracle(name, q[b, :, h], k[b, :, h], v[b, :, h], None if g is None else g[b, :, h])
        for h in range(H)], dim=1) for b in range(B)])


def test_generated_kernels_tuned_under_the_interpreter_match_float64(tmp_path):
    """Every tuned launch of linear's forward and backward (schedules, warps, stages,
    state-pass and reverse-pass widths) gives the oracle's outputs and gradients; the
    winners the clock prefers are stored."""
    def cost(c):   # prefers the chunk form, fused, narrow blocks, 8 warps, 1 stage
        if "form" in c:
            return 1.0 if c["form"] == "chunk" else 2.0
        if "schedule" in c:
            return 1.0 if c["schedule"] == "fused" else 2.0
        return sum(v for n, v in c.items() if n.startswith("B_")) - c["num_warps"] + c["num_stages"]
    tuner = CostTuner(tmp_path / "t.json", cost)
    op = hladsl.load("linear", backend="triton", chunk_size=16)
    gen = torch.Generator().manual_seed(5)
    B, T, H, d = 1, 40, 2, 32
    q, k, v = (torch.randn(B, T, H, d, generator=gen) for _ in range(3))
    g = -0.2 * torch.rand(B, T, H, generator=gen)
    w = torch.randn(B, T, H, d, generator=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    with autotune.tuning(tuner, {**SHAPE, "dims": [["d", 32], ["dv", 32]], "gated": True}):
        o, _ = op(*leaves[:3], g=leaves[3], scale=1.0)
        got = torch.autograd.grad((o * w).sum(), leaves)
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v, g)]
    want_o = _oracle_heads("linear", *ref_leaves)
    want = torch.autograd.grad((want_o * w.double()).sum(), ref_leaves)
    torch.testing.assert_close(o.double(), want_o, rtol=1e-4, atol=1e-4)
    for a, b in zip(got, want):
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < 1e-4, f"relative gradient error {err:.2e}"

    entries = {tuple(json.loads(k).get(f) for f in ("runner", "kernel")): v
               for k, v in json.loads((tmp_path / "t.json").read_text())["entries"].items()}
    assert entries[("form", None)] == {"form": "chunk"}
    assert entries[("forward_triton", None)] == {"schedule": "fused"}
    assert entries[("backward_triton", None)] == {"schedule": "fused"}
    widths = [x for v in entries.values() for n, x in v.items() if n.startswith("B_")]
    assert widths and set(widths) == {16}
    kernels = {k.rpartition(".")[2] for _, k in entries if k}
    assert {"fused_kernel", "state_pass_kernel", "output_kernel", "fused_bwd_kernel"} <= kernels
    launches = [v for (_, k), v in entries.items() if k]
    assert all(v["num_warps"] == 8 and v["num_stages"] == 1 for v in launches)


@pytest.fixture
def loud(monkeypatch):
    """Progress lines on (the interpreter silences them) after 50 ms."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("HLADSL_QUIET", raising=False)
    monkeypatch.setattr(progress, "SLOW_S", 0.05)


def test_a_slow_compile_prints_one_numbered_line_a_fast_one_none(loud, capsys):
    kernels = [FakeKernel("slow_a", compile_s=0.3), FakeKernel("fast_b"),
               FakeKernel("slow_c", compile_s=0.3)]
    x = torch.zeros(2)

    def call():
        for kernel in kernels:
            launch.launch(kernel, (1,), {"x": x, "C": 16}, False)
    progress.counted(("slow-compile test", id(kernels)), call)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["hladsl: compiling fake_fwd.slow_a [1/3]...",
                     "hladsl: compiling fake_fwd.slow_c [3/3]..."]
    assert all(len(k.launches) == 1 for k in kernels)   # the dry run launched nothing
    progress.counted(("slow-compile test", id(kernels)), call)   # compiled: quiet
    assert capsys.readouterr().err == ""


def test_every_launch_option_makes_its_own_variant(loud, capsys):
    """A compiled variant is its constexprs and launch options (``direct.LAUNCH_OPTIONS``): the
    same kernel under a register cap compiles again, and progress says so."""
    kernel = FakeKernel("slow_capped", compile_s=0.3)
    for options in ({}, {"maxnreg": 168}):
        progress.counted(("cap test", id(kernel), tuple(options)),
                         lambda o=options: launch.launch(kernel, (1,), {"C": 16, **o}, False))
        assert capsys.readouterr().err.splitlines() == ["hladsl: compiling fake_fwd.slow_capped [1/1]..."]
    assert progress.variant(kernel, {"C": 16}) != progress.variant(kernel, {"C": 16, "maxnreg": 168})


def test_hladsl_quiet_silences_progress(loud, monkeypatch, capsys):
    monkeypatch.setenv("HLADSL_QUIET", "1")
    kernel = FakeKernel("slow_quiet", compile_s=0.3)
    progress.counted(("quiet test", id(kernel)),
                     lambda: launch.launch(kernel, (1,), {"C": 16}, False))
    assert capsys.readouterr().err == "" and len(kernel.launches) == 1


def test_a_slow_tuning_run_prints_its_line(loud, tmp_path, capsys):
    class SlowTuner(CostTuner):
        def measure(self, candidate, fn):
            time.sleep(0.02)
            return candidate["num_warps"]
    kernel = FakeKernel("tuned_k", compile_s=0.1)
    with autotune.tuning(SlowTuner(tmp_path / "t.json", None), SHAPE):
        launch.launch(kernel, (1,), {"C": 16}, True)
    assert capsys.readouterr().err.splitlines() == ["hladsl: tuning fake_fwd.tuned_k (6 candidates)..."]


def test_the_counting_dry_run_leaves_results_exact(monkeypatch):
    """With progress on, the first call of a shape class runs twice: a dry run that
    counts the kernels to compile, then the real one: outputs and gradients stay the
    oracle's."""
    monkeypatch.setattr(progress, "quiet", lambda: False)
    monkeypatch.setattr(progress, "SLOW_S", 1e9)
    recorded = []
    record = progress.record
    monkeypatch.setattr(progress, "record", lambda k, a: (recorded.append(k), record(k, a)))
    op = hladsl.load("hla2", backend="triton", chunk_size=16)
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 23, 1, 8, generator=gen) for _ in range(3))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, _ = op(*leaves, scale=1.0)
    got = torch.autograd.grad(o.square().sum(), leaves)
    assert recorded   # forward and backward were counted first
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    want_o = _oracle_heads("hla2", *ref, None)
    want = torch.autograd.grad(want_o.square().sum(), ref)
    torch.testing.assert_close(o.double(), want_o, rtol=1e-4, atol=1e-4)
    for a, b in zip(got, want):
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-4
