"""Rules of the launch layer that need no kernel: the schedule and the chunk size."""
import pytest
import torch

from hladsl.runtime import launch


class _Cuda:
    type = "cuda"


@pytest.fixture
def as_written():
    """Calls run the spec as written: these tests are about its launch rules (a stateless call
    would run the carried form's op, launch.CARRY_DERIVED, which has its own, tests/test_carried.py)."""
    with launch.switched(CARRY_DERIVED=False):
        yield


@pytest.fixture
def gpu_of_132_sms(monkeypatch):
    monkeypatch.setattr(launch, "sms", lambda device: 132)
    return _Cuda()


def test_auto_fuses_only_many_pairs_over_several_chunks(gpu_of_132_sms):
    dev = gpu_of_132_sms
    many = 2 * 132
    assert launch.use_fused("auto", True, dev, many, n_chunks=4)
    assert not launch.use_fused("auto", True, dev, many - 1, n_chunks=4)   # chunk parallelism fills better
    # one chunk (T <= 64, where narrow chunks occur): nothing to fuse, and hla2's fused
    # kernel faulted at C = 16 on the H100
    assert not launch.use_fused("auto", True, dev, 1024, n_chunks=1)
    assert not launch.use_fused("auto", False, dev, many, n_chunks=4)     # no fused kernel (packed)
    assert not launch.use_fused("two_pass", True, dev, many, n_chunks=4)
    assert launch.use_fused("fused", True, dev, 1, n_chunks=1)            # asked for explicitly
    assert not launch.use_fused("auto", True, torch.device("cpu"), many, n_chunks=4)
    with pytest.raises(ValueError, match="schedule"):
        launch.use_fused("fast", True, dev, many, n_chunks=4)


def test_chunks_shrink_to_short_sequences_only_on_cpu():
    cpu, cuda = torch.device("cpu"), _Cuda()
    assert launch.chunk_for(1, 64, cpu) == 16
    assert launch.chunk_for(17, 64, cpu) == 32
    assert launch.chunk_for(1000, 64, cpu) == 64
    # CUDA: kernels at C = 16 faulted on the H100; a short sequence runs one chunk of 64
    assert launch.chunk_for(1, 64, cuda) == 64
    assert launch.chunk_for(16, 64, cuda) == 64
    assert launch.chunk_for(1000, 32, cuda) == 32    # an explicit chunk_size is kept
    assert launch.chunk_for(1000, None, cpu) == 64   # None: the rules choose
    assert launch.chunk_for(1000, None, cuda) == 64


def test_long_chunk_where_the_rule_says_so_and_only_past_one_long_chunk(monkeypatch):
    cuda = _Cuda()
    yes, no = (lambda: True), (lambda: False)
    assert launch.chunk_for(4096, None, cuda, "forward", yes) == 128
    assert launch.chunk_for(4096, None, cuda, "forward", no) == 64
    assert launch.chunk_for(128, None, cuda, "forward", yes) == 64     # one long chunk would hold it all
    assert launch.chunk_for(4096, 64, cuda, "forward", yes) == 64      # the user's chunk_size wins
    assert launch.chunk_for(4096, None, torch.device("cpu"), "forward", yes) == 64   # interpreter: <= 64
    monkeypatch.setattr(launch, "BACKWARD_CHUNK", 32)
    assert launch.chunk_for(4096, None, cuda, "backward", yes) == 32   # the A/B knob
    assert launch.chunk_for(4096, None, cuda, "forward", no) == 64


@pytest.mark.parametrize("spec, forward, backward, wide_forward", [
    ("linear", True, True, True),          # chunk scan; gradient kernels memory-bound at 128
    ("hla2", True, False, True),           # chunk scan; gradient kernels compute-bound at 128
    ("ahla", True, False, True),
    ("hla3_masked", True, False, False),   # at d = 128 its kernels pass 150 FLOP/byte at 128
    ("hla3", False, False, False),         # no chunk scan: its state pass walks the tokens
    ("power", False, False, True),         # packed states: walks; at d = 128 its forward takes 128
])
def test_which_programs_take_the_long_chunk(gpu_of_132_sms, spec, forward, backward, wide_forward):
    import hladsl
    from hladsl.ir.pipeline import program_for
    op = hladsl.load(spec)
    sizes = tuple((dim, 16) for dim in sorted(op.algebra.dims))

    def takes(direction, schedule="auto", programs=32, varlen=False, gated=False):
        return launch.takes_long_chunk(lambda chunk: program_for(op.compilation, chunk, sizes, gated),
                                       direction, schedule, programs, gpu_of_132_sms, varlen, 2)
    assert takes("forward") is forward
    assert takes("backward") is backward
    assert not takes("forward", gated=True) and not takes("backward", gated=True)   # decay tiles spill
    wide = tuple((dim, 128) for dim, _ in sizes)      # [128, 128] tiles: by the cost model's intensity

    def takes_wide(direction, gated=False):
        return launch.takes_long_chunk(lambda chunk: program_for(op.compilation, chunk, wide, gated),
                                       direction, "auto", 32, gpu_of_132_sms, False, 2)
    assert takes_wide("forward") is wide_forward
    assert not takes_wide("backward") and not takes_wide("backward", gated=True)
    # gated at wide dims: only where each output term multiplies one [C, C] decay tile (linear, power)
    assert takes_wide("forward", gated=True) is (wide_forward and spec in ("linear", "power"))
    wider = tuple((dim, 256) for dim, _ in sizes)     # past WIDE_LONG_CHUNK_TILE: unmeasured, keeps 64
    assert not launch.takes_long_chunk(lambda chunk: program_for(op.compilation, chunk, wider, False),
                                       "forward", "auto", 32, gpu_of_132_sms, False, 2)
    if forward:
        assert not takes("forward", schedule="two_pass")     # a schedule asked for keeps 64
        assert not takes("forward", programs=2 * 132)         # the fused schedule takes these
        assert not takes("forward", varlen=True)              # every sequence pads to a chunk


def test_auto_takes_chunk_scans_with_aux_summaries_at_the_long_chunk():
    scan = {"aux": ["aux_R_0"]}
    short = torch.empty(1, 2, 4, 64, 16, dtype=torch.bfloat16)
    long = torch.empty(1, 2, 4, 128, 16, dtype=torch.bfloat16)
    assert not launch.use_chunk_scan("auto", scan, short, walk_chained=True)
    assert launch.use_chunk_scan("auto", scan, long, walk_chained=True)
    assert not launch.use_chunk_scan("auto", scan, long, walk_chained=False)   # the walk splits (linear)


def _without_fitting_kernels(monkeypatch, op):
    """op on CPU tensors as if on a GPU where no generated kernel fits (every chunk and
    fallback raising OutOfResources, as hla2's reverse pass at d = 128 does on the H100)."""
    from triton.runtime.errors import OutOfResources

    def nothing_fits(key, chunk, run):
        raise OutOfResources(262144, 232448, "shared memory")
    monkeypatch.setattr(launch, "fitting_chunk", nothing_fits)
    monkeypatch.setattr(op, "use_triton", lambda x, backend=None: True)


def _inputs():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    return q, k, v


def test_auto_runs_the_torch_program_when_no_kernel_fits_and_warns_once(monkeypatch, as_written):
    import hladsl
    from hladsl.runtime import op as op_module
    monkeypatch.setattr(op_module, "_NO_KERNEL_WARNED", set())
    ref_op = hladsl.load("hla2", backend="torch")
    q, k, v = _inputs()
    o_ref, _ = ref_op(q, k, v)
    want = torch.autograd.grad(o_ref.square().sum(), (q, k, v))
    auto = hladsl.load("hla2")            # a distinct op object (backend "auto")
    _without_fitting_kernels(monkeypatch, auto)
    with pytest.warns(RuntimeWarning, match="do not fit this GPU") as caught:
        o, _ = auto(q, k, v)
        got = torch.autograd.grad(o.square().sum(), (q, k, v))
    assert {str(w.message).split("'s generated ")[1].split()[0] for w in caught} == {"forward", "backward"}
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # the same shape again: no second warning
        auto(q, k, v)


def test_backend_triton_names_the_spec_and_shape_when_no_kernel_fits(monkeypatch, as_written):
    import hladsl
    op = hladsl.load("hla2", backend="triton")
    _without_fitting_kernels(monkeypatch, op)
    q, k, v = _inputs()
    with pytest.raises(RuntimeError, match=r"hla2: no generated forward kernel fits this GPU at dims"):
        op(q, k, v)


def test_cached_launch_plans_hold_no_tensor():
    """A plan outlives its call: its Tiling's retile closure must not keep a token tile
    (and so a call's input-sized buffer) alive."""
    import hladsl
    from hladsl.runtime import triton_backward, triton_forward
    op = hladsl.load("linear", backend="triton")
    x = [torch.randn(1, 64, 1, 8, requires_grad=True) for _ in range(3)]
    o, _ = op(*x)
    o.sum().backward()
    plans = list(triton_forward._PLANS.values()) + list(triton_backward._PLANS.values())
    assert plans

    def tensors_in(value, seen=()):
        if isinstance(value, torch.Tensor):
            return [value]
        if callable(value) and getattr(value, "__closure__", None):
            return [t for cell in value.__closure__ for t in tensors_in(cell.cell_contents)]
        if isinstance(value, tuple):
            return [t for v in value for t in tensors_in(v)]
        return []
    for plan in plans:
        for name in ("state_launch", "reverse_launch", "fused_launch"):
            if hasattr(plan, name):
                grid, block, tiling = getattr(plan, name)
                assert not tensors_in(tiling.retile), name


def test_remembered_builds_a_plan_once_bypasses_when_told_and_starts_over_when_full(monkeypatch):
    builds = []

    def build():
        builds.append(1)
        return object()
    cache = {}
    first = launch.remembered(cache, "k", build)
    assert launch.remembered(cache, "k", build) is first and len(builds) == 1
    assert launch.remembered(cache, "k", build, cacheable=False) is not first and len(builds) == 2
    monkeypatch.setattr(launch, "PLANS_KEPT", 2)
    launch.remembered(cache, "j", build)
    launch.remembered(cache, "i", build)      # full: starts over, keeps the new one
    assert list(cache) == ["i"]


def test_a_chunk_that_fit_one_spec_is_not_another_specs(monkeypatch, as_written):
    """The chunk the kernels fit at is remembered per spec and shape class: hla3's kernels
    needing C = 32 once ran hla2, at the same shape, at C = 32 too (with fp32 dots, 3.6x
    slower: the H100 bench of this round)."""
    import hladsl
    from hladsl.runtime import triton_forward
    from triton.runtime.errors import OutOfResources
    asked = []

    def fake_forward(program, tiles, lam, init, *args, **kwargs):   # fits at C <= 32 for hla3
        asked.append((program.algebra.name, program.chunk))
        if program.algebra.name == "hla3" and program.chunk > 32:
            raise OutOfResources(262144, 232448, "shared memory")
        n, h, n_chunks, chunk = next(iter(tiles.values())).shape[:4]
        o = triton_forward.token_layout(n, h, n_chunks, chunk, 8, torch.float32, "cpu")
        return o.zero_(), {s: torch.zeros((n, h) + program.state_shape(s)) for s, _ in program.states}
    monkeypatch.setattr(triton_forward, "forward_triton", fake_forward)
    q, k, v = (torch.randn(1, 128, 2, 8) for _ in range(3))
    for name in ("hla3", "hla2", "hla3"):
        op = hladsl.load(name)
        monkeypatch.setattr(op, "use_triton", lambda x, backend=None: True)
        op(q, k, v)
    assert asked == [("hla3", 64), ("hla3", 32), ("hla2", 64), ("hla3", 32)]


def test_chunk_starts_in_the_output_dot_dtype_only_where_that_rounds_them_anyway(monkeypatch):
    """bf16 chunk starts only for a state the output kernel reads as SDOT operands alone,
    with SDOT bf16 (fp16 inputs keep fp32 SDOT: a state can pass fp16's range)."""
    import triton.language as tl
    assert launch.starts_dtype(True, tl.bfloat16) == torch.bfloat16
    assert launch.starts_dtype(False, tl.bfloat16) == torch.float32
    assert launch.starts_dtype(True, tl.float32) == torch.float32
    assert launch.starts_dtype(True, launch.state_dot_dtype(torch.float16)) == torch.float32
    monkeypatch.setattr(launch, "STARTS_IN_SDOT", False)
    assert launch.starts_dtype(True, tl.bfloat16) == torch.float32


def test_which_states_the_output_kernel_reads_only_as_sdot_operands():
    """codegen.triton_gen.read_only_as_sdot on the shipped programs: linear's S, ahla's P
    and E, power's U qualify; hla2's states feed fp32 products (its derived carry W_P = S C)
    and elementwise terms, so none does."""
    import hladsl
    from hladsl.codegen.triton_gen import kernel_context, read_only_as_sdot
    from hladsl.ir.pipeline import chunk_program
    assert read_only_as_sdot("t = _dot(tl.trans(st_P), x, SDOT, PREC)", "st_P")
    assert not read_only_as_sdot("t = _dot(_dot(st_S, st_C, tl.float32, PREC), y, SDOT, PREC)", "st_S")
    assert not read_only_as_sdot("t = _dot(x, y, SDOT, PREC) * st_S", "st_S")
    expected = {"linear": {"S"}, "ahla": {"P", "E"}, "power": {"U"}, "hla2": set()}
    for name, want in expected.items():
        alg = hladsl.compile_spec(name)
        ctx = kernel_context(chunk_program(alg, 64, tuple(sorted((x, 64) for x in alg.dims)), True))
        assert {s["name"] for s in ctx["states"] if s["read"] and s["starts_sdot"]} == want, name


@pytest.mark.parametrize("spec, gated, forward, backward", [
    ("linear", False, True, True), ("hla2", False, True, False), ("hla2", True, False, False),
    ("power", False, False, False)])
def test_the_op_asks_the_long_chunk_rule_per_direction(monkeypatch, gpu_of_132_sms, spec, gated,
                                                       forward, backward):
    """An op call hands chunk_for the rule for its own direction, dims and gate (what a CUDA
    call would take; on CPU the interpreter's chunk is kept, so the rule is only asked here):
    a plain forward the forward's, a fwd + bwd the backward's for both (the forward runs the
    backward's state pass at its chunk, launch.KEEP_STATE_PASS)."""
    import hladsl
    asked = {}
    real = launch.chunk_for

    def spy(T, chunk_size, device=None, direction="forward", long_chunk=None):
        if long_chunk is not None:
            asked[direction] = long_chunk()
        return real(T, chunk_size, device, direction, long_chunk)
    monkeypatch.setattr(launch, "chunk_for", spy)
    op = hladsl.load(spec, backend="triton")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 20, 2, 16, generator=gen, requires_grad=True) for _ in range(3))
    g = -0.1 * torch.rand(1, 20, 2, generator=gen) if gated else None
    with torch.no_grad():
        op(q, k, v, g=g)
    assert asked == {"forward": forward}
    asked.clear()
    op(q, k, v, g=g)[0].sum().backward()
    assert asked == {"backward": backward}


def test_the_backward_scans_in_groups_where_few_walkers_walk_many_chunks(gpu_of_132_sms):
    """launch.scan_groups: ceil(nC / L) groups in the backward, L the power of two nearest √nC
    up to SCAN_GROUP (launch.scan_group_len), for dense calls of a groupable scan with at
    least 2 SCAN_GROUP chunks and fewer walkers than SCAN_GROUP_FILL programs an SM; one
    level otherwise, and in the forward."""
    dev, group = gpu_of_132_sms, launch.SCAN_GROUP
    assert [launch.scan_group_len(n) for n in (64, 256, 300, 1024, 4096)] == [8, 16, 16, 32, group]
    assert launch.scan_groups(1024, 32, dev, False, True, "backward") == 1024 // 32
    assert launch.scan_groups(256, 32, dev, False, True, "backward") == 256 // 16
    assert launch.scan_groups(300, 32, dev, False, True, "backward") == 19   # the last group short
    assert launch.scan_groups(2 * group - 1, 32, dev, False, True, "backward") == 1
    assert launch.scan_groups(1024, 32, dev, False, True, "forward") == 1
    assert launch.scan_groups(1024, 32, dev, True, True, "backward") == 1     # varlen
    assert launch.scan_groups(1024, 32, dev, False, False, "backward") == 1   # not groupable
    assert launch.scan_groups(1024, launch.SCAN_GROUP_FILL * 132, dev, False, True, "backward") == 1


@pytest.mark.parametrize("spec,groupable", [("hla2", True), ("linear", True), ("ahla", False),
                                            ("hla3_masked", False)])
def test_which_scans_can_group(spec, groupable):
    """A group of chunks is one chunk to a scan whose per-chunk buffers are all states' deltas
    (hla2, linear); AHLA's and HLA3-masked's read chunk summaries no state holds (ir.scan's
    AuxDelta), which have no combine. The reverse scan groups with its forward."""
    import hladsl
    from hladsl.codegen.triton_bwd import backward_context
    from hladsl.codegen.triton_gen import kernel_context
    from hladsl.ir.pipeline import chunk_program
    program = chunk_program(hladsl.compile_spec(spec), 64, (("d", 64), ("dv", 64)), True)
    assert kernel_context(program)["chunk_scan"]["groupable"] is groupable
    assert backward_context(program)["reverse_scan"]["groupable"] is groupable


def test_a_launch_with_an_argument_the_kernel_lacks_fails_as_on_a_gpu():
    """Triton raises on a GPU for a keyword argument a kernel has no parameter for; its
    interpreter ignores it. direct.call (every interpreter launch) raises too, naming the
    kernel and the arguments, so CPU tests see the launches a GPU would refuse."""
    import triton
    import triton.language as tl

    from hladsl.runtime import direct

    @triton.jit
    def kernel(x_ptr, N: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, N), tl.zeros((N,), tl.float32))
    x = torch.ones(4)
    direct.call(kernel, (1,), {"x_ptr": x, "N": 4, "num_warps": 1})
    assert x.sum() == 0
    with pytest.raises(TypeError, match="kernel has no parameter.*STORE_DERIVED"):
        direct.call(kernel, (1,), {"x_ptr": x, "N": 4, "STORE_DERIVED": False})


def test_split_walkers_of_wide_value_free_states_run_one_a_sm(gpu_of_132_sms):
    """HLA2's scan at d = 128 repeats its 128 x 128 S in every value block: its blocks narrow
    only while the grid fits one program a SM (32 walkers: 4 blocks of 32, not 8 of 16);
    at d = 64 (S of 4096 elements) the two-a-SM rule stays."""
    import hladsl
    from hladsl.ir.pipeline import program_for
    op = hladsl.load("hla2")

    def program(d):
        return program_for(op.compilation, 64, (("d", d), ("dv", d)), False)
    assert launch.wide_value_free(program(128), ("dv",))
    assert not launch.wide_value_free(program(64), ("dv",))
    assert not launch.wide_value_free(program(128), ("d", "dv"))   # S split too: nothing value-free
    power = hladsl.load("power")                                      # packed dims count by their table
    assert launch.wide_value_free(program_for(power.compilation, 64, (("d", 64), ("dv", 64)), False), ())
    assert launch.state_blocks({"dv": 128}, 32, gpu_of_132_sms, True, one_per_sm=True) == {"dv": 32}
    assert launch.state_blocks({"dv": 128}, 32, gpu_of_132_sms, True) == {"dv": 16}
    assert launch.state_blocks({"dv": 128}, 200, gpu_of_132_sms, True, one_per_sm=True) == {"dv": 128}   # a wave
    assert launch.state_blocks({"dv": 128}, 32, gpu_of_132_sms, False, one_per_sm=True) == {"dv": 128}   # chained
    # two split dims narrow in turn, the first of equals first, while the grid fits one wave:
    # 64 x 128 (64 programs), 64 x 64 (128); 32 x 64 would be 256
    assert launch.state_blocks({"dv": 128, "d": 128}, 32, gpu_of_132_sms, True) == {"dv": 64, "d": 64}
    assert launch.state_blocks({"dv": 64, "d": 64}, 32, gpu_of_132_sms, True) == {"dv": 32, "d": 32}
    assert launch.state_blocks({"dv": 64, "d": 128}, 16, gpu_of_132_sms, True) == {"dv": 32, "d": 32}
    assert launch.state_blocks({"dv": 64, "d": 64}, 256, gpu_of_132_sms, True) == {"dv": 64, "d": 64}
    # ... from at most TWO_SPLIT_MAX_BLOCK (fla's 64 x 64): past one wave, never whole 128 x 128 tiles
    assert launch.state_blocks({"dv": 128, "d": 128}, 100, gpu_of_132_sms, True) == {"dv": 64, "d": 64}
    assert launch.state_blocks({"dv": 128, "d": 128}, 100, gpu_of_132_sms, False) == {"dv": 128, "d": 128}   # chained
    # a stage of a two-stage scan counts the states it walks: HLA3-normalised's second stage
    # holds G1..G3 (split) and h1..h3 (192 value-free elements), not SK, SQ and m
    hla3 = program_for(hladsl.load("hla3", normalize=True).compilation, 64, (("d", 64), ("dv", 64)), False)
    assert launch.wide_value_free(hla3, ("dv",))
    assert not launch.wide_value_free(hla3, ("dv",), ("G1", "G2", "G3", "h1", "h2", "h3"))


def test_launch_switches_from_the_environment_are_checked_and_typed():
    assert launch.switches_from_env("EXACT_STATE_DOTS=bf16x3 STAGE_WARPS=8, STAGE_BLOCK=none FORWARD_CHUNK=64 "
                                    "STAGE_PARTS=term") == {
        "EXACT_STATE_DOTS": "bf16x3", "STAGE_WARPS": 8, "STAGE_BLOCK": None, "FORWARD_CHUNK": 64, "STAGE_PARTS": "term"}
    assert launch.switches_from_env("") == {} and launch.switches_from_env(None) == {}
    for bad, says in (("NO_SUCH_RULE=1", "no launch rule constant"), ("STAGE_WARPS", "NAME=VALUE"),
                      ("KEEP_STATE_PASS=4", "is a bool"), ("SCAN_GROUP=many", "is a int"),
                      ("KEEP_STATE_PASS=treu", "is a bool"), ("FORWARD_CHUNK=abc", "takes a positive whole number or none"),
                      ("GRAD_MAXNREG=true", "positive whole number"), ("GRAD_MAXNREG=1.5", "positive whole number"),
                      ("GRAD_MAXNREG=0", "positive whole number"),
                      ("EXACT_DOTS=bf16x2", "is one of tf32x3"), ("EXACT_STATE_DOTS=none", "is one of"),
                      ("STAGE_PARTS=terms", "is one of state, term")):
        with pytest.raises(ValueError, match=says) as err:
            launch.switches_from_env(bad)
        assert bad in str(err.value) and "HLADSL_LAUNCH" in str(err.value)


def test_exact_products_per_kernel_role_and_never_bf16x3_under_the_interpreter():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with launch.switched(EXACT_DOTS="tf32x3", EXACT_STATE_DOTS="bf16x3"):
        assert launch.exact_precision(cuda) == "tf32x3"
        assert launch.exact_precision(cuda, state_pass=True) == "bf16x3"
        assert launch.exact_precision(cpu, state_pass=True) == "tf32x3"   # the interpreter's set
    with pytest.raises(ValueError, match="EXACT_DOTS is one of"):
        launch.switch("EXACT_DOTS", "bf16x2")


def test_output_kernel_takes_eight_warps_at_wide_dims_unless_told():
    assert launch.output_warps({"B_d": 64, "B_dv": 64}) == {}
    assert launch.output_warps({"B_d": 128, "B_dv": 64}) == {"num_warps": 8}
    with launch.switched(OUTPUT_WARPS=4):
        assert launch.output_warps({"B_d": 128, "B_dv": 128}) == {"num_warps": 4}


def test_stage_kernels_take_eight_warps_at_wide_dims_unless_told():
    assert launch.stage_warps({"B_d": 64, "B_dv": 64}) == 4
    assert launch.stage_warps({"B_d": 128, "B_dv": 128}) == 8
    with launch.switched(STAGE_WARPS=4):
        assert launch.stage_warps({"B_d": 128, "B_dv": 128}) == 4


def test_a_bad_launch_setting_in_the_environment_is_one_line_from_the_cli():
    import os
    import subprocess
    import sys
    env = {**os.environ, "HLADSL_LAUNCH": "SCAN_GROUP=many"}
    proc = subprocess.run([sys.executable, "-m", "hladsl", "compile", "linear", "--emit", "chunk"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "hladsl: HLADSL_LAUNCH: SCAN_GROUP=many: launch.SCAN_GROUP is a int, got 'many'"


def test_output_kernels_narrow_tile_guard_sees_the_packed_loop_tile():
    """The output / cotangent kernels loop over a packed dim: a packed tile below 64 makes
    their chained bf16 dots fp32 (``dot_override``), as a narrow block or feature dim does."""
    import triton.language as tl

    import hladsl
    from hladsl.ir.pipeline import chunk_program
    from hladsl.runtime import launch
    program = chunk_program(hladsl.compile_spec("power", p=2), 64, (("d", 64), ("dv", 64)), True)
    first = torch.empty(1, 1, 4, 64, 64, dtype=torch.bfloat16)
    features = {"B_d": 64, "B_dv": 64}
    for tile, want in ((64, {}), (32, {"DOT": tl.float32, "SDOT": tl.float32})):
        packed = launch.packed_blocks(program, {"B_d_pow2": tile})
        assert packed == {"B_d_pow2": tile}
        assert launch.dot_override(first, True, packed, features) == want


def _tf32_launch(**changes):
    import triton.language as tl
    return {"num_warps": 8, "PREC": "tf32x3", "DOT": tl.float32, "SDOT": tl.float32,
            "C": 64, "B_d": 64, "B_dv": 64, **changes}


def test_tf32_dots_keep_a_narrow_tile_in_one_warpgroup():
    """Triton 3.6 on Hopper splits a [64, N] dot's N over the two warpgroups of 8 warps, and a
    tf32 warpgroup of N = 8 reads unpadded shared memory (triton-lang/triton#10629; hla3's fp32
    reverse pass at value blocks of 16, runs 258-261): such a launch keeps 4 warps."""
    import triton.language as tl
    assert launch.wgmma_safe(_tf32_launch(B_dv=16))["num_warps"] == 4
    assert launch.wgmma_safe(_tf32_launch(C=16))["num_warps"] == 4
    assert launch.wgmma_safe(_tf32_launch(PREC="tf32", B_d=16))["num_warps"] == 4
    assert launch.wgmma_safe(_tf32_launch(DOT=tl.bfloat16, B_dv=16))["num_warps"] == 4   # fp32 state dots
    for kept in (_tf32_launch(B_dv=32), _tf32_launch(B_dv=16, PREC="ieee"),
                 _tf32_launch(B_dv=16, DOT=tl.bfloat16, SDOT=tl.bfloat16), _tf32_launch(B_dv=16, num_warps=4)):
        assert launch.wgmma_safe(kept) == kept
    with launch.switched(TF32_SPLIT_MIN_TILE=0):
        assert launch.wgmma_safe(_tf32_launch(B_dv=16))["num_warps"] == 8


def test_a_launch_and_its_fallbacks_run_the_wgmma_safe_warps(monkeypatch):
    """``launch`` applies the rule to what it is given and to each fallback it tries (the
    last fallback asks for 8 warps)."""
    from triton.runtime.errors import OutOfResources

    from hladsl.runtime import direct
    launched, fits = [], [False] * (len(launch.FALLBACKS) - 1) + [True]

    def call(kernel, grid, args, key_args=None):
        launched.append(args["num_warps"])
        if not fits[len(launched) - 1]:
            raise OutOfResources(1, 0, "shared memory")
    monkeypatch.setattr(direct, "cached", lambda kernel, grid, args: False)
    monkeypatch.setattr(direct, "call", call)
    monkeypatch.setattr(launch, "_WORKING", {})
    kernel = object()
    launch.launch(kernel, (1,), _tf32_launch(B_dv=16, num_warps=4), may_fall_back=True)
    assert launch.FALLBACKS[-1].get("num_warps") == 8 and launched == [4] * len(launch.FALLBACKS)
    launched.clear()
    fits[0] = True
    launch.launch(kernel, (1,), _tf32_launch(B_dv=16), may_fall_back=False)
    assert launched == [4]


def test_gradient_kernels_with_tf32_tiles_run_at_8_warps():
    """At 4 warps gated ahla's fp32 gradient kernel wrote shared memory out of bounds inside
    a tf32 dot (run 263, memcheck); at 8 it ran (runs 263-264). bf16 calls keep the rule by
    feature width."""
    narrow = {"B_d": 64, "B_dv": 64}
    assert launch.grad_warps(narrow, tf32=True) == {"num_warps": 8}
    assert launch.grad_warps(narrow) == {}
    assert launch.grad_warps({"B_d": 128, "B_dv": 128}) == {"num_warps": 8}
    with launch.switched(GRAD_WARPS=4):
        assert launch.grad_warps(narrow, tf32=True) == {"num_warps": 4}
    assert launch.tf32_tiles(_tf32_launch()) and not launch.tf32_tiles(_tf32_launch(PREC="ieee"))
