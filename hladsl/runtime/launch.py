"""The launch layer: every rule that picks how a generated kernel is launched
(chunk size, block widths, warps, pipeline stages, schedule, dot dtype) and
every fallback, each with its reason, in one place. The kernel runners
(``triton_forward``, the backward and step runners) ask it; they hold no
tuning knobs of their own.

Rules:
* chunk size: the op's chunk where it gives one, else 64, or 128 on CUDA for dense
  ungated "auto" calls of programs with a chunk scan and dims of at most 64 (the forward; the backward where its
  gradient kernels stay memory-bound), and at dims of 128 for a forward the cost model keeps
  below WIDE_LONG_CHUNK_INTENSITY, gated too where each output term multiplies one [C, C]
  mask, packed walking states included (power at d = 128) (``chunk_for``, ``takes_long_chunk``); on CPU shrunk
  to the sequence for short inputs (power of two, >= 16: tl.dot's minimum); halved while a
  kernel does not fit the GPU's shared memory (``fitting_chunk``); what fit is remembered
  per shape class.
* launch options: the default software pipelining first; one stage, then eight
  warps when shared memory runs out (``launch``, remembered per kernel).
* state-pass blocks of its split dims (the value dim; a second dim where the program
  allows, ``codegen.triton_gen._state_splits``): narrow enough to fill the GPU
  (``state_blocks``; one program a SM for a scan whose value-free states are wide:
  ``wide_value_free``, and for two split dims), except where Hopper miscompiles narrow chained dots (narrowing those
  anyway with fp32 dots measured slower for ahla's and hla3_masked's reverse passes,
  faster for hla2's: RESULTS round 10, so it is not a rule); a state or
  reverse pass that fits no launch fallback at its width runs narrower blocks
  (``narrower``) before the chunk is halved.
* fp32 tiles for chains of bf16/fp16 dots at a narrow chunk or block (``dot_override``).
* how the precision plan's fp32-accurate products run on the tensor cores, in the state
  passes and in the output and gradient kernels: tf32x3, bf16x3 (``exact_precision``).
* what the kernels read and write: the query scale applied as query tiles are loaded
  (``SCALE_QUERIES_IN_KERNEL``); the forward's chunk-start states in the output kernel's
  state-dot dtype where it only feeds them to such dots (``starts_dtype``), the backward's
  where every reader does, or dΛ's inner products besides in a stateless call
  (``rounded_starts``); its d-states so where nothing needs them sharp (``d_states_dtype``).
* warps and pipeline stages of a state-pass / reverse-pass program from the fp32 state
  elements it holds (``walker_options``); the forward output kernel's and the stage kernels'
  at wide dims (``output_warps``, ``stage_warps``).
* schedule: fused (one kernel) when there are enough (sequence, head) pairs to
  fill the GPU without chunk parallelism and more than one chunk, else two-pass
  (``use_fused``); its state pass chunk-parallel (deltas, then a scan over them) where
  the walking one cannot be split over the value dim (``use_chunk_scan``; its scan kernel
  prefetching the next chunk's deltas, ``SCAN_PREFETCH``), a forward's complete scan in two
  stages where its sequential products are large (``forward_module``), the backward's
  too where its one-stage reverse pass would walk (``backward_module``: its reverse pass
  then in two stages), and the
  backward's reverse pass chunk-parallel after it (``use_reverse_scan``), its cotangents
  written over its per-chunk parts where that is safe (``reverse_in_place``: memory);
  the backward's scans in two levels, groups of chunks then a walk over the groups,
  where few (sequence, head) pairs walk many chunks (``scan_groups``).
* gradient kernels: one gradient target group (a token input, or Λ) per program
  (``grad_target_sets``), so that one target's tiles are live at a time; the packed
  dim they loop over in tiles of at most 4096 [C, tile] elements (``grad_loop_tile``); a target with many
  networks over several programs (``grad_parts``, ``grad_fitting_parts``); 8 warps at feature dims of 128 (``grad_warps``).
* the attention form (``ir.attention``) for calls with no state in or out of programs that have one,
  forward and backward, where its multiply-adds are at most ATTENTION_MAC_RATIO x the chunk form's
  (``use_attention_form``); its backward's stages by feature width (``attention_launch``).
* the carried form (``ir.carried``) for calls with no state in or out where ``CARRY_DERIVED``
  (on), one adding product summaries where ``CARRY_PRODUCTS`` too (on; ``op.Op._carried_op``).
* A/B runs in separate processes: ``HLADSL_LAUNCH="NAME=VALUE ..."`` sets rule constants
  at import (``switches_from_env``), as ``hladsl bench --launch`` does within one.
* autotuning (optional, ``runtime.autotune``): the candidates a tuned launch times
  (``tune_candidates``: warps, stages, and the state-pass / reverse-pass value-dim
  block where ``split_blocks`` allows splitting); the schedule is tuned by the runners.
* decode step: warps from the fp32 state elements a program holds (``step_warps``,
  ``step_free_warps``); the bridged split or the shared one where some states lack the value
  dim (``STEP_BRIDGED``), the value-dim block (``step_value_block``); inputs of more than
  ``STEP_MAX_TOKENS`` tokens run as consecutive launches when the kernel sums outputs in a
  [T, value block] register tile or the bridged split's scratch holds one piece of them.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from hladsl.codegen.triton_gen import block_size, column_pick_macs
from hladsl.errors import SettingError
from hladsl.ir.chunk import ChunkProgram
from hladsl.runtime import autotune, binding, direct, progress

# triton is imported inside the rules that need it: the torch path never imports it
# (and the Triton interpreter must be chosen before triton is first imported)
TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)


def dot_dtype(dtype: torch.dtype, device=None):
    """The tl dtype tiles of ``dtype`` enter ``tl.dot`` in (fp32 tiles: tl.float32). On CPU
    tensors (the Triton interpreter) always fp32: Triton 3.9's interpreter multiplies bf16
    dot operands wrongly (relative errors ~1e9 for linear in bf16)."""
    import triton.language as tl
    if device is not None and device.type == "cpu":
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(dtype, tl.float32)


def state_dot_dtype(dtype: torch.dtype, device=None, exact: bool = False):
    """The tl dtype of products reading carried states (and d-states) outside the precision
    plan's exact sums: bf16 for bf16 inputs (its range is fp32's); fp32 for fp16 inputs, as a
    state (a sum over the sequence) or a d-state can pass fp16's 65504 (hla2's backward at
    d = 24 overflowed, tests/test_op_triton.py); fp32 where the plan makes them all exact
    (``exact``: ir.precision rule 5, the backward of a degree-three cancellation)."""
    import triton.language as tl
    return tl.bfloat16 if dot_dtype(dtype, device) == tl.bfloat16 and not exact else tl.float32
STARTS_IN_SDOT = True


OUTPUT_WARPS = None        # the forward's output kernel at these warps whatever the rule says (A/B)
WIDE_OUTPUT_DIM = 128
WIDE_OUTPUT_WARPS = 8


def output_warps(features: dict) -> dict:
    """The forward output kernel's warps where they differ from the call's (4): 8 where a
    feature dim is at least 128 (``features``: ``feature_blocks``), whose tiles spill at 4
    (hla2's 1896 B a thread, compiled for sm_90). Measured (runs 158, 159, H100, bf16,
    B = 2, H = 16, T = 16384, 4 -> 8 warps): at d = 128 hla2 3.785 -> 3.415 ms, ahla 2.036 ->
    1.707, linear 0.6725 -> 0.6394, hla3_masked 6.012 -> 6.096; at d = 64 slower (hla2
    0.714 -> 0.737, hla3 3.83 -> 4.29)."""
    if OUTPUT_WARPS:    # (a forward_triton num_warps does not reach the output kernel at wide
        return {"num_warps": OUTPUT_WARPS}   # dims: its output_options do, and autotuning)
    if max(features.values(), default=0) >= WIDE_OUTPUT_DIM:
        return {"num_warps": WIDE_OUTPUT_WARPS}
    return {}


EXACT_DOTS = "tf32x3"
EXACT_STATE_DOTS = "tf32x3"
EXACT_DOT_MODES = ("tf32x3", "bf16x3", "bf16x6", "ieee")


def exact_precision(device, state_pass: bool = False) -> str:
    """tl.dot's ``input_precision`` for fp32 tiles: the precision plan's fp32-accurate
    products (``ir.precision``), fp16's state products, the one-hot dots of packed power
    factors (``triton_gen.slot_columns``) and of the power gradient's chain rule, for fp32
    tokens or where ``dot_override`` makes them fp32. "tf32x3": three tf32 dots (hi*hi + hi*lo + lo*hi), ~21 bits, each tf32 pass
    at half the bf16 rate; "bf16x3": three bf16 dots of a 16-bit hi + lo split, ~16 bits
    at twice tf32x3's speed; "bf16x6": ~24 bits at tf32x3's cost. ``state_pass``: the
    state passes' kernels (``EXACT_STATE_DOTS``: the chunk-start and final states, the
    backward's recomputed ones), else the kernels that form outputs and gradients
    (``EXACT_DOTS``: where the cancelling sums are; the fused kernels, one PREC for their
    states and outputs, too). Products with a token side do not use it (``codegen.steps``:
    in the input dtype, or three bf16 dots). The Triton interpreter (CPU tensors) knows
    tf32x3 only (and computes it in fp32)."""
    if torch.device(device).type != "cuda":
        return "tf32x3"
    return EXACT_STATE_DOTS if state_pass else EXACT_DOTS   # (one of EXACT_DOT_MODES: check_switch)


def starts_dtype(read_only_as_sdot: bool, sdot) -> torch.dtype:
    """The dtype the forward stores a state's chunk-start values in for the output kernel:
    that kernel's SDOT (bf16 for bf16 inputs) where it reads the state only as an SDOT dot
    operand (``codegen.triton_gen.read_only_as_sdot``), so rounding at the store instead of
    at the dot gives the same bits in half the bytes written and read; fp32 otherwise (a
    state read elementwise, in an exact product, or SDOT fp32). Measured (run 79, H100,
    B = 2, H = 16, d = 64, bf16, forward at T = 64k, fp32 -> bf16 starts): linear 1.079 ->
    0.890 ms (fla 0.885), ahla 2.718 -> 1.981, power p = 2 58.3 -> 55.4. The backward's
    chunk starts likewise, where every kernel reading them reads them so
    (``triton_bwd._starts_sdot``): hla3 fwd + bwd 6.17 -> 5.86 ms, the same gradients (run 273)."""
    import triton.language as tl
    if STARTS_IN_SDOT and read_only_as_sdot and sdot == tl.bfloat16:
        return torch.bfloat16
    return torch.float32


# The backward's chunk starts in SDOT also where, besides SDOT dot operands, the gradient kernels
# read them only in whole-state inner products with the chunk-end cotangent -- gated programs' dΛ
# scalars <dS_end, S_start> (``triton_gen.starts_read_as_sdot(inner_products=True)``), which then
# sum bf16-rounded starts (each product in fp32: ``codegen.steps._STORED_STATE``): not the
# same bits. Run 281 (H200, B = 2, H = 16, d = 64, bf16, stateless, same process): gated hla3_masked
# fwd + bwd at T = 16k 5.864 -> 5.044 ms; the gated stateless plain bf16 GPU cases at d = 64 (two-pass)
# pass with it (dg against fp32 at most 4.11e-3: ahla 4.11e-3, hla3 4.07e-3, hla2 3.34e-3, bar 1e-2);
# d = 128, the scan / staged / auto schedules and varlen have not run with it on a GPU.
# STATELESS_GATED_STARTS_IN_SDOT: that rule for a call that forms no d initial state, of a program
# whose quotient rule does not cancel (not normalised: ``ir.precision.quotient_cancelling``, as the
# d-states' rule); GATED_STARTS_IN_SDOT: for every call (an A/B switch, off).
STATELESS_GATED_STARTS_IN_SDOT = True
GATED_STARTS_IN_SDOT = False


def rounded_starts(sharp: bool) -> bool:
    """Does a backward plan take the starts dΛ's inner products read rounded (above)? ``sharp``:
    the call forms a d initial state, or the program's quotient cancels."""
    return GATED_STARTS_IN_SDOT or (STATELESS_GATED_STARTS_IN_SDOT and not sharp)


# The reverse scan's per-chunk d-states in HBM -- its chunk parts and the chunk-end d-states the
# gradient kernels read -- in the backward's state-dot dtype where nothing needs them sharper
# (``d_states_dtype``). Not where a d initial state is formed from them: ungated HLA2's d C_init is
# S_initᵀ Σ_c dW0_c, formed as Σ_c S_cᵀ dW0_c (the parts) minus the cross terms' ΔSᵀ dG, which
# cancel to a part in |S_B| / |S_init|: bf16 parts and dG made its RMS ratio against fp32 1.5e-2 (bar
# 1e-2; fp32: 2.3e-6), dk 2.9e-3 -> 4.4e-3 (run 227, H100, T = 8192, d = 64, bf16). Nor where the
# quotient rule's cotangents sum nearly cancelling parts (``ir.precision.quotient_cancelling``).
# Elsewhere (a call with no state in: the token gradients only) each stored d-state is rounded once,
# 2^-9 of itself, and so is each chunk's part the scan sums them from: hla3 fwd + bwd 5.86 -> 5.29 ms
# at T = 16384 (B = 2, H = 16, d = 64, H200), its dk, dv 3.88e-3 -> 4.21e-3 against fp32, 3.4e-3
# from the fp32-stored gradients (run 273). STATELESS_D_STATES_IN_SDOT: that rule (an A/B switch);
# D_STATES_IN_SDOT: bf16 even where they are needed sharp (an A/B switch, off).
STATELESS_D_STATES_IN_SDOT = True
D_STATES_IN_SDOT = False


def d_states_dtype(sdot, sharp: bool = True) -> torch.dtype:
    """The dtype the reverse scan stores its per-chunk d-states in (its parts, the chunk-end
    d-states; its walks carry them in fp32 registers): bf16 where the backward's state products
    run in bf16 (``sdot``, ``stored_sdot``'s: fp32 where the precision plan makes its state reads
    exact, rule 5) and either nothing needs them ``sharp`` (a d initial state formed from them,
    quotient-cancelling d-states) under ``STATELESS_D_STATES_IN_SDOT``, or ``D_STATES_IN_SDOT``;
    else fp32."""
    import triton.language as tl
    wanted = D_STATES_IN_SDOT or (STATELESS_D_STATES_IN_SDOT and not sharp)
    return torch.bfloat16 if sdot == tl.bfloat16 and wanted else torch.float32


def stored_sdot(first, common: dict, features: dict):
    """The state-dot dtype the backward stores starts and d-states in (``starts_dtype``,
    ``d_states_dtype``): the plan's SDOT, or fp32 where ``dot_override`` sends a narrow chunk's or
    feature dim's state dots to fp32 (a Hopper miscompile's workaround): bf16 stores there would
    not be the bits those fp32 dots read. (A launch narrowed at run time past those widths,
    ``launch_narrowing``, reads them as stored: the bf16 path's precision.)"""
    return dot_override(first, True, {}, features).get("SDOT", common["SDOT"])


MIN_CHUNK = 16


DEFAULT_CHUNK = 64
LONG_CHUNK = 128
FORWARD_CHUNK = None    # a size: every forward's chunk on CUDA, whatever the rule says (an A/B knob)
BACKWARD_CHUNK = None   # the same for the backward
# FLOPs per HBM byte below which a kernel is memory-bound: the H100's dense bf16 tensor-core
# peak over its bandwidth (989 TFLOP/s / 3.35 TB/s)
MEMORY_BOUND_INTENSITY = 295.0
LONG_CHUNK_TILE = 128 * 64   # the most elements of a [C, dim] token tile at the long chunk
# Past LONG_CHUNK_TILE, up to WIDE_LONG_CHUNK_TILE (measured at d = 128), a forward takes the long
# chunk where the cost model keeps its kernels below WIDE_LONG_CHUNK_INTENSITY FLOP/byte there.
WIDE_LONG_CHUNK_TILE = 128 * 128
WIDE_LONG_CHUNK_INTENSITY = 150.0


def chunk_for(T: int, chunk_size: int | None, device=None, direction: str = "forward",
              long_chunk: Callable[[], bool] | None = None) -> int:
    """The chunk size of a call. ``chunk_size``: the op's (None: these rules choose). On CPU
    (the torch path, the Triton interpreter) it is shrunk to the smallest power of two >= T
    (>= 16). On CUDA a short sequence runs one whole chunk: the H100 took illegal addresses
    in kernels at C = 16 (hla3's and hla3_masked's output kernels, hla2's reverse and fused
    kernels; B = 1 and 64, T = 1 and 16, with fp32 tiles too), while one chunk of 64 costs a
    short sequence nothing measurable; a sequence longer than LONG_CHUNK runs LONG_CHUNK where
    ``long_chunk()`` (``takes_long_chunk``) says so. The forward and the backward need not
    share a chunk size: the backward recomputes what it reads."""
    if device is not None and device.type == "cuda":
        if chunk_size is not None:
            return chunk_size
        forced = FORWARD_CHUNK if direction == "forward" else BACKWARD_CHUNK
        if forced:
            return forced
        return LONG_CHUNK if T > LONG_CHUNK and long_chunk is not None and long_chunk() else DEFAULT_CHUNK
    return min(chunk_size or DEFAULT_CHUNK, max(MIN_CHUNK, 1 << max(T - 1, 0).bit_length()))


def takes_long_chunk(program_at: Callable[[int], object], direction: str, schedule: str, programs: int,
                     device, varlen: bool, token_bytes: int) -> bool:
    """LONG_CHUNK instead of DEFAULT_CHUNK for a dense, ungated "auto" call that the fused
    schedule does not take, where the program has the chunk-parallel state pass
    (``ir.scan.has_chunk_scan``): a chunk's start states cost as many bytes at 128 tokens as
    at 64, so the state traffic per token halves -- and with it the scan's sequential steps --
    while every state pass either runs chunk-parallel (``use_chunk_scan`` takes the scan at
    this chunk) or walks without chained dots (linear). H100, B = 2, H = 16, d = 64, bf16,
    forward at T = 64k (runs 81-84): hla2 4.43 -> 2.87 ms, hla3_masked 6.96 -> 5.24, ahla
    2.00 -> 1.84, linear 0.889 -> 0.772. Not taken:

    * without a chunk scan: the walk holds 128-token tiles in a sequential loop, or expands
      packed states into them, and spills (sm_90: AHLA's walking state pass 640 B of stack
      at 128, power's output kernel 1824 B; power p = 2 15.3 -> 22.5 ms at T = 16k, run 82;
      d = 64 3.61 -> 4.54 on the H200, run 277) -- except a forward whose packed states walk
      at tiles past LONG_CHUNK_TILE (the rules below then apply): there the output kernel,
      one program a SM at 255 registers either way, reads half the chunk-start bytes a token.
      Power p = 2 gated at d = 128, T = 16k, H200, same process: 38.68 -> 32.98, 38.65 ->
      33.14, 38.64 -> 33.12 ms (runs 276-278), ungated 33.70 -> 25.11 (run 279); the H100
      took 37.55 -> 39.4 in round 30 (run 211: state pass 19.73 -> 30.22, output 18.30 ->
      9.06), on code since changed, a GPU no longer lent;
    * gated, except a forward at wide dims (below) whose output terms each multiply one [C, C]
      mask (``ChunkProgram.masks_per_output_term``: linear): the decay tiles exp(Λ_t − Λ_s)
      beside every intra-chunk product push the output kernel past its registers at 128
      (hla2's: 1624 B of stack gated, 432 B ungated); run 85, gated, T = 64k, C = 64 vs 128:
      linear forward 0.980 vs 1.126 ms, hla2 5.04 vs 5.21 (8 warps remove the spill and lose
      more ungated, run 83); run 185, linear gated at d = 64 0.950 vs 1.042 ms, but at d = 128,
      where a chunk's bf16 starts are 512 of 2560 bytes a token at 64, 2.495 vs **1.882**
      (fla's gated forward 2.076);
    * dims wider than 64, where the long chunk's [C, dim] tiles pass LONG_CHUNK_TILE (128 x 64,
      where it was measured faster for every program with a chunk scan): the backward, dims
      past WIDE_LONG_CHUNK_TILE (128 x 128: unmeasured), and a forward with a kernel at or past
      WIDE_LONG_CHUNK_INTENSITY FLOP/byte at the long chunk by the cost model -- compute-bound
      on [128, 128] tiles of fp32-accurate state products; run
      136, d = 128, T = 16k, forward, C = 128 vs 64: hla3_masked (257 and 270 FLOP/byte at
      128) 18.3 vs 6.1 ms, while hla2 (100, 116) 4.53 vs 7.37, ahla (110, 128) 1.99 vs 2.10,
      linear (32, 64) 0.671 vs 0.705;
    * varlen: each sequence pads to a whole chunk;
    * the backward, where its gradient kernels, whose FLOPs grow with the chunk, are not
      memory-bound at it (the cost model's FLOP/byte at or over MEMORY_BOUND_INTENSITY):
      HLA2's, AHLA's (fwd + bwd 25.1 -> 40.9 ms for hla2 at 64k with both at 128, run 82);
      linear's are (fwd + bwd 5.17 -> 4.44 ms at 64k, run 82)."""
    from hladsl.ir.scan import has_chunk_scan
    if schedule != "auto" or varlen or programs >= FUSED_MIN_PROGRAMS_PER_SM * sms(device):
        return False
    program = program_at(LONG_CHUNK)
    tile = LONG_CHUNK * max(n for _, n in program.sizes)
    if not has_chunk_scan(program) and not (program.packed and tile > LONG_CHUNK_TILE):
        return False
    from hladsl.ir.cost import kernel_costs
    if program.gated and (tile <= LONG_CHUNK_TILE or program.masks_per_output_term() > 1):
        return False
    if tile > LONG_CHUNK_TILE:
        return (direction == "forward" and tile <= WIDE_LONG_CHUNK_TILE
                and all(k.intensity < WIDE_LONG_CHUNK_INTENSITY for k in kernel_costs(program, None, token_bytes)))
    if direction == "forward":
        return True
    from hladsl.ir.backward import backward_program
    costs = kernel_costs(program, backward_program(program), token_bytes)
    return next(k for k in costs if k.kernel == "gradient").intensity < MEMORY_BOUND_INTENSITY


_FITTING: dict = {}    # shape class -> the chunk size whose kernels fit


def fitted(key, chunk: int) -> int:
    """The chunk ``fitting_chunk`` settled on for ``key`` when asked ``chunk`` (``chunk``
    where it has not run or did not halve)."""
    return _FITTING.get((key, chunk), chunk)


def fitting_chunk(key, chunk: int, run):
    """``run(chunk)``, halving the chunk while the kernels need more shared memory
    than the GPU has (large states at d = 128); the chunk that fit is remembered."""
    from triton.runtime.errors import OutOfResources
    chunk = fitted(key, chunk)
    asked = chunk
    while True:
        try:
            out = progress.counted((key, chunk), lambda size=chunk: run(size))
        except OutOfResources:
            if chunk <= MIN_CHUNK:
                raise
            chunk //= 2
            continue
        if chunk != asked and _FITTING.get((key, asked)) != chunk:
            fit_changed()
        _FITTING[(key, asked)] = chunk
        return out


_FIT_CHANGES = [0]


def fit_changed() -> None:
    """A launch settled on less than its plan (a halved chunk, a reverse pass that walks
    instead of scanning): what a bound training call keys on (``op._training_key``), since
    the forward plans for the backward's chunk and scan."""
    _FIT_CHANGES[0] += 1


def fit_changes() -> int:
    return _FIT_CHANGES[0]


def state_blocks(sizes: dict[str, int], programs: int, device, narrow_ok: bool,
                 one_per_sm: bool = False) -> dict[str, int]:
    """Blocks of a state-pass program's split dims (not packed ones): halve the widest
    padded block (not below 16, tl.dot's minimum; the first of equals) while that leaves
    fewer programs than two per SM; with ``one_per_sm`` (``wide_value_free``), or two dims
    to split, only while the halved grid still fits one program a SM. Two dims narrow in
    turn: each block reloads the token tiles of both dims' blocks, so past one wave more
    programs cost more loads than they hide. Run 183 (H100, B = 2, H = 16, bf16, linear's
    forward at T = 64k): d = 128 blocks of 32 x 32 (512 programs, the two-a-SM rule)
    2.572 ms, 64 x 64 (128) 1.893 (fla 1.911; 2.726 before, d unsplit, dv in 16s, run 176);
    d = 64 16 x 16 1.206, 32 x 32 0.7655, 64 x 64 0.7617 (fla 0.887). Two split dims start
    at most TWO_SPLIT_MAX_BLOCK wide: fla's chunk_fwd_h tiles, what run 183 measured best; the
    one-wave rule alone would keep 128 x 128 tiles, one program a (sequence, head), from 67
    to 263 of them at d = 128 (unmeasured).
    Without ``narrow_ok`` the full widths are kept: Triton 3.6's Hopper wgmma (seen on the H100)
    lowering miscompiles some chains of dots (a matmul reading a matmul result)
    on narrow bf16/fp16 tiles -- hla3's state pass at widths 16 and 32 gives NaN
    or an illegal address (cf. triton-lang/triton issues 6124, 10486, 11366) --
    while fp32 (tf32x3) and dot chains without such reads split correctly."""
    widths = {dim: block_size(size) for dim, size in sizes.items()}
    if not narrow_ok:
        return widths
    n_sms = sms(device)
    if len(sizes) > 1:
        one_per_sm = True
        widths = {dim: min(w, TWO_SPLIT_MAX_BLOCK) for dim, w in widths.items()}

    def grid(ws: dict) -> int:
        return programs * math.prod(-(-sizes[d] // w) for d, w in ws.items())
    while True:
        dim = max((d for d in widths if widths[d] > 16), key=lambda d: widths[d], default=None)
        if dim is None:
            return widths
        halved = {**widths, dim: widths[dim] // 2}
        if not (grid(halved) <= n_sms if one_per_sm else grid(widths) < 2 * n_sms):
            return widths
        widths = halved


STATE_BLOCK = None   # every split walk's non-packed blocks at this width, whatever the rule says (A/B)
PACKED_BLOCK = None  # every forward's packed-dim tile (triton_gen.PACKED_TILE's 64 by default; A/B)
TWO_SPLIT_MAX_BLOCK = 64


# A split scan walker whose value-free states (no split dim) pass WIDE_VALUE_FREE_ELEMENTS narrows
# only while its grid fits one program a SM. Every value block repeats the walk of those states
# and loads their delta tiles, and their fp32 dot operands take most of an SM's shared memory
# (HLA2's scan at d = 128: S is 128 x 128, 147456 B at one stage), so two a SM do not fit and
# narrower blocks only add repeats and a second wave. Run 137 (H100, B = 2, H = 16, d = 128,
# bf16, forward at the long chunk): hla2 4.53 -> 3.70 ms at 16k, 17.47 -> 14.24 at 64k (value
# blocks of 32, not 16: 128 programs); the d = 64 forwards and hla2's d = 128 backward unchanged.
# Scan kernels only: the rule was measured there (the forward's scan; hla2's fwd + bwd at d = 128
# unchanged with it on every walker, whose reverse pass walks unsplit there).
WIDE_VALUE_FREE_ELEMENTS = 8192


def wide_value_free(program, splits, states=None) -> bool:
    """Does every program of a split walk (of ``states``; None: every streaming state) repeat
    more than WIDE_VALUE_FREE_ELEMENTS elements of value-free states (HLA2's S at d = 128)?"""
    names = [s.name for s in program.algebra.streaming] if states is None else states
    free = sum(math.prod(program.state_shape(n)) for n in names
               if not set(program.state_dims(n)) & set(splits))
    return free > WIDE_VALUE_FREE_ELEMENTS


FUSED_MIN_PROGRAMS_PER_SM = 2


def sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1



def use_fused(schedule: str, has_fused: bool, device, programs: int, n_chunks: int) -> bool:
    """The fused schedule under "auto": enough (sequence, head) pairs to fill the GPU
    without chunk parallelism, and more than one chunk: with one there is no walk to fuse
    (the two-pass state pass only writes the initial state as the chunk's start). (The
    H100 fault that showed this, hla2's fused kernel at B = 64, T = 1, was at C = 16,
    which ``chunk_for`` no longer gives on CUDA.)"""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
    if schedule == "fused":
        return True
    return (schedule == "auto" and has_fused and device.type == "cuda" and n_chunks > 1
            and programs >= FUSED_MIN_PROGRAMS_PER_SM * sms(device))


SCHEDULES = ("auto", "two_pass", "fused", "scan", "staged")


# A complete chunk scan (every state-pass term a carry, a delta or a scan term) walks, in its
# sequential phase, carried states times delta tiles: HLA2's G += ΔS (ρ C), d x d x dv MACs a
# chunk; HLA3-masked's three through its aux summaries, 4 d^3. Split in two stages
# (``ir.scan.staged_scan(complete=True)``), those products become every chunk's increment at
# once from the lower states' stored starts, and both walks are elementwise -- for more
# bytes (the lower starts and the increments go through HBM; the output kernel forms its
# derived carries, HLA2's W0, itself). A forward that runs its own state pass takes that
# module where the walk's products reach STAGED_SCAN_MACS a chunk and head; the backward (and
# an eager forward under autograd, which runs the backward's, KEEP_STATE_PASS) keeps the
# one-stage scan, whose deltas the reverse scan reads, except where ``backward_module`` takes
# the two-stage one (its reverse pass then in two stages, reading no delta).
# H100 (run 175, B = 2, H = 16, bf16, forward, ms, one stage -> two, at 16k / 64k): HLA3-masked
# (4 d^3) at d = 64 1.279 -> 0.918, 4.903 -> 3.595, at d = 128 6.068 -> 4.185, 24.0 -> 16.52;
# HLA2 and AHLA (d^3) at d = 128 3.245 -> 3.192 and 12.96 -> 12.33, 1.726 -> 1.605 and 6.655
# -> 6.262 -- but at d = 64 (262144 MACs) slower: 0.713 -> 0.854 and 2.736 -> 3.245, 0.480 ->
# 0.585 and 1.843 -> 2.213. The threshold lies between the sizes measured, 2^18 and 2^20 MACs.
STAGED_SCAN_MACS = 1 << 19


def forward_module(schedule: str, ctx: dict) -> tuple[str, bool]:
    """(the schedule to plan, whether to take the module whose complete chunk scan runs in
    two stages) for a forward that runs its own state pass (not the fused kernel), from its
    one-stage module's context: "staged" asks for two stages where the program's scan splits
    so (``triton_gen._stageable_scan_macs`` > 0), and is the one-stage "scan" elsewhere (HLA3,
    whose scan has two stages only; linear, whose has no second); "auto" takes them where the
    scan's sequential products reach STAGED_SCAN_MACS a chunk and head, while
    AUTO_STAGED_SCAN is on. Two stages hold no chunk summary outside the states (the upper
    states' aux terms are their increments'), so AUTO_SCAN_AUX does not hold back their scan."""
    macs = ctx["stageable_scan_macs"]
    if schedule == "staged":
        return "scan", bool(macs)
    return schedule, bool(schedule == "auto" and AUTO_STAGED_SCAN and macs and macs >= STAGED_SCAN_MACS)


def use_chunk_scan(schedule: str, chunk_scan: dict | None, first, walk_chained: bool) -> bool:
    """The chunk-parallel state pass (``delta_kernel`` over every chunk at once, then
    ``scan_kernel`` walking the deltas; ``triton_gen._chunk_scan``) instead of the walking
    ``state_pass_kernel``: when asked for ("scan"), and under "auto" where the program has
    one, the tiles span more than one chunk, and the walking pass cannot split its value
    dim (chained bf16 / fp16 dots, ``state_blocks``): it then walks with one program per
    (sequence, head) -- hla2 at B = 2, H = 16: 32 programs on 132 SMs, 85 % of its forward --
    while the scan kernel, with no token work and no chained dots, splits. "staged" is "scan"
    here: two stages of a complete scan are a module's of their own (a forward's,
    ``forward_module``; the backward's, ``backward_module``)."""
    if schedule in ("scan", "staged"):
        if not chunk_scan:
            raise autotune.Unavailable("this program has no chunk-parallel state pass (a state is packed, "
                                       "or a walking term reads states that are not first-stage ones)")
        return True
    return (schedule == "auto" and bool(chunk_scan) and first.shape[2] > 1
            and not narrow_ok(first, walk_chained)
            and (AUTO_SCAN_AUX or not chunk_scan["aux"] or first.shape[3] >= LONG_CHUNK)
            and (AUTO_STAGED_SCAN or not chunk_scan["stage"]))


# Under "auto", the two-stage chunk scan (``ir.scan.staged_scan``: HLA3's, and a forward's
# complete scan split so, ``forward_module``) instead of the walk, whose one program per
# (sequence, head) carries every state through every chunk.
AUTO_STAGED_SCAN = True
# The second stage's increment kernel (``stage_kernel``): its value-dim block where set (None:
# ``state_blocks``'s rule) and its warps where set (None: ``stage_warps``' rule).
STAGE_BLOCK = None
STAGE_WARPS = None
# The stage kernel's launches: one a state ("state"), or one a term where a state has several
# ("term": each later term adds its state's running sum from HBM; HLA3's 12 terms compile for
# sm_90 with no stack where its 3 states spill 160-1648 B a thread at d = 64 / 128 -- not yet
# timed on the GPU, hence not the default). ``codegen.triton_gen._second_stage``'s part_sets.
STAGE_PARTS = "state"
STAGE_PARTS_MODES = ("state", "term")
WIDE_STAGE_WARPS = 8


def stage_warps(features: dict) -> int:
    """The stage kernels' warps (the forward's ``stage_kernel``, the backward's
    ``rstage_kernel``): 4, and WIDE_STAGE_WARPS where a feature dim is at least
    WIDE_OUTPUT_DIM (as the output kernel's, ``output_warps``; ``rstage_kernel`` there is not
    timed: HLA3's kernels compile for minutes at d = 128). It holds the lower states it
    reads and one upper state's increment, not every state as a walker does: ``walker_warps``
    would give HLA3's 8 at d = 64, where its 255 registers a thread keep one program a SM. H100,
    B = 2, H = 16, bf16, T = 16k, forward: HLA3 at d = 64 (run 143) 13.22 ms at 8 warps, 8.30 at
    4 (value blocks of 32: 21.13, 14.11 at 4); HLA3-masked's complete scan in two stages (run
    178) at d = 64 0.918 at 4, 1.053 at 8; at d = 128 4.192 at 4, 3.749 at 8 (value blocks of
    64: 3.893, of 32: 28.0) -- for sm_90 its stage kernel there holds 255 registers and 792 B
    of stack a thread at 4 warps, 202 and none at 8 (``benchmarks/compile_probe.py``)."""
    if STAGE_WARPS:
        return STAGE_WARPS
    return WIDE_STAGE_WARPS if max(features.values(), default=0) >= WIDE_OUTPUT_DIM else 4


# The scan kernel loads the next chunk's deltas (which do not depend on the carry) while it
# applies this chunk's: its walk is a chain of short steps, each waiting on its loads otherwise.
SCAN_PREFETCH = True


# The two-level scan (``scan_groups``). A scan walks one chunk per step, each step a chain of
# loads, a few products and stores that one program per (sequence, head) and value block runs
# in order: hla2 at T = 65536, B = 2, H = 16 walked 512 (C = 128) and 1024 (C = 64) steps at
# 2.2 and 4.2 µs each, ~1 TB/s (run 91: its forward and reverse scans, 7.3 of 23.2 ms of fwd +
# bwd). In groups of SCAN_GROUP chunks (the combine is associative) the walk runs in three
# launches of the same kernel: every group walks its chunks from zero to its own delta (one
# program per group: SCAN_GROUP-fold parallelism), one walk over the groups' deltas gives each
# group's start, and every group walks again from it writing the chunk starts. The deltas are
# read twice (the bytes grow by half) and the sequential depth falls from nC to ~2 L + nC / L
# for groups of L chunks (``scan_group_len``: ~√nC, at most SCAN_GROUP).
SCAN_GROUP = 32
SCAN_GROUP_FILL = 4     # grouped only while the one-level walkers fill fewer than this many a SM
SCAN_GROUP_FORWARD = False   # group the forward's own scan too (measured slower, below)


def scan_groups(n_chunks: int, walkers: int, device, varlen: bool, groupable: bool, direction: str) -> int:
    """Groups of the scan's walk (1: one level): ceil(nC / ``scan_group_len``) in the backward (its
    recomputed state pass, whose groups' deltas the reverse scan walks, and the reverse scan),
    where the program's scan can group (``triton_gen._chunk_scan``'s groupable), the call is
    dense (varlen sequences are the walkers already), there are at least 2 SCAN_GROUP chunks,
    and the ``walkers`` ((sequence, head) pairs) leave the GPU short of SCAN_GROUP_FILL
    programs an SM. Measured (runs 92, 93, hla2, B = 2, H = 16, T = 65536, fwd + bwd): the
    reverse scan 4.27 -> 2.92 ms (its one-level walk moved ~0.9 TB/s), the recomputed forward
    scan ~0.2 ms slower (its one level already moves ~1.3 TB/s and the groups read the deltas
    twice), so the forward alone stays one level (2.87 vs 3.09 ms), ``SCAN_GROUP_FORWARD``.
    The backward's plan keeps one level where no grouped reverse scan reads the groups'
    deltas (a fused backward, a reverse pass that walks). Value blocks follow ``state_blocks``'s
    rule at each launch's program count (runs 93, 94: 16- or 32-wide groups and 32- or
    64-wide one-level walks were slower)."""
    if (not groupable or varlen or not SCAN_GROUP or n_chunks < 2 * SCAN_GROUP
            or walkers >= SCAN_GROUP_FILL * sms(device)
            or (direction == "forward" and not SCAN_GROUP_FORWARD)):
        return 1
    return -(-n_chunks // scan_group_len(n_chunks))


def scan_group_len(n_chunks: int) -> int:
    """Chunks in a group of the two-level scan: 2^floor(bits(nC) / 2), about √nC (16 for 256
    to 511 chunks, 32 for 512 to 2047), at most SCAN_GROUP. Measured (run 129, hla2, B = 2, H = 16, fwd + bwd,
    the forward running the backward's grouped scan, ``KEEP_STATE_PASS``): at T = 16k (256
    chunks) groups of 16 / 32 / 64: 5.12 / 5.29 / 6.05 ms; at 64k (1024 chunks): 19.76 /
    19.49 / 19.47 -- the walk over the groups (nC / L steps) against the groups' own walks
    (2 L steps, reading every delta twice)."""
    return max(1, min(SCAN_GROUP, 1 << (n_chunks.bit_length() // 2)))


# Under "auto" at chunks shorter than LONG_CHUNK, chunk scans that read chunk summaries no
# state holds (``ir.scan.AuxDelta``) stay off: on the H100 (run 70, B = 2, H = 16, d = 64,
# bf16, C = 64) they lose for AHLA (forward 0.67 -> 0.86 ms at 16k, fwd + bwd 4.4 -> 5.0) and
# tie or win for HLA3-masked (forward 1.94 / 1.96, fwd + bwd 13.9 -> 12.4); a tuning session
# (``op.autotune``) times "scan" beside the others. At LONG_CHUNK they run (the walk would
# hold 128-token chained tiles): run 82, forward at 64k, scan at 128 vs the walk at 64:
# AHLA 1.90 vs 2.00 ms, HLA3-masked 5.30 vs 6.96 (the walk at 128: 5.56, 7.97). A complete
# scan in two stages (``forward_module``) holds no such summary: this does not hold it back
# (HLA3-masked's forward at C = 64, gated, T = 16k: 1.99 ms walking, 1.31 in two stages, run 177).
AUTO_SCAN_AUX = False


def use_reverse_scan(schedule: str, chunk_scan: bool, reverse_scan: dict | None) -> bool:
    """The backward's chunk-parallel reverse pass (``rdelta_kernel``, then ``rscan_kernel``;
    ``triton_bwd._reverse_scan``) instead of the walking ``reverse_kernel``, wherever the
    chunk-start states came from the chunk-parallel state pass (its scan reads that pass's
    per-chunk deltas) and the program has one: "scan", and "auto" where ``use_chunk_scan``
    took the scan. The walking reverse pass cannot split its value dim for the same reason
    the walking state pass cannot. H100, hla2, B = 2, H = 16, d = 64, bf16 (run 70): fwd + bwd
    12.55 -> 6.70 ms at T = 16k, 49.7 -> 26.4 at 64k; bf16 errors against fp32 equal to the
    walking pass's to three digits (``benchmarks/schedule_check.py``). It holds the forward
    deltas and every chunk's d-state parts beside the chunk-end cotangents: 3.12x fla's peak
    memory for hla2 fwd + bwd (run 73; the walking pass 2.45x), 2.89x once the d-states it
    splits are written over their own parts (run 74; 7.31 / 28.1 ms there, another lease).
    In two stages (``reverse_scan["stage"]``, HLA3) it reads no forward delta, only the chunk
    starts; it runs while ``STAGED_REVERSE`` (the A/B switch against the walk)."""
    staged_ok = STAGED_REVERSE or not (reverse_scan or {}).get("stage")
    return chunk_scan and bool(reverse_scan) and staged_ok and schedule in ("scan", "staged", "auto")


def backward_module(schedule: str, ctx: dict, first) -> bool:
    """Whether the backward takes the module whose recomputed state pass is the complete
    chunk scan in two stages and whose reverse pass is then the two-stage one
    (``triton_bwd.backward_context(stage_complete=True)``), from its one-stage module's
    context: "staged" takes it where the program's complete scan and its reverse pass split
    so (and STAGED_REVERSE); "auto" where, besides, its sequential products reach
    STAGED_SCAN_MACS a chunk and head (as ``forward_module``), a chunk scan would run
    (``use_chunk_scan``'s test: a walk that splits its value dim walks) and the one-stage
    module's reverse pass would walk (its chunk scan not taken: the forward deltas it would
    read hold aux summaries, AUTO_SCAN_AUX) and the token features are at most
    STAGED_BACKWARD_MAX_DIM wide, while AUTO_STAGED_BACKWARD and AUTO_STAGED_SCAN.
    H100, B = 2, H = 16, d = 64, bf16, fwd + bwd at 16k / 64k (run 207): HLA3-masked (4 d^3) 13.0 -> 7.55 and 50.8 -> 29.3 ms (its walking
    reverse pass was 7.06 of 13.1, its walking state pass 1.84: run 206); AHLA (d^3) slower,
    2.92 -> 4.57 and 11.2 -> 17.8 -- its walks are short."""
    fwd = ctx["forward"]
    if (not fwd["stageable_scan_macs"] or not ctx["staged_reverse"] or not STAGED_REVERSE
            or schedule not in ("staged", "auto")):
        return False
    if schedule == "staged":
        return True
    scans = first.shape[2] > 1 and not narrow_ok(first, fwd["state_chained_dots"])
    one_stage = use_chunk_scan(schedule, fwd["chunk_scan"], first, fwd["state_chained_dots"])
    return (AUTO_STAGED_BACKWARD and AUTO_STAGED_SCAN and fwd["stageable_scan_macs"] >= STAGED_SCAN_MACS
            and scans and first.shape[4] <= STAGED_BACKWARD_MAX_DIM
            and not use_reverse_scan(schedule, one_stage, ctx["reverse_scan"]))


AUTO_STAGED_BACKWARD = True
# measured at d = 64 only (runs 207, 208): wider features keep one stage under "auto" until timed
# (AHLA's products reach STAGED_SCAN_MACS at d = 128, where its two-stage forward wins, run 175)
STAGED_BACKWARD_MAX_DIM = 64


# The reverse pass in two stages (``ir.scan.staged_reverse``) where a program has it, instead
# of the walking ``reverse_kernel`` whose one program per (sequence, head) runs every d-state
# network of every chunk: HLA3's was 64 % of its fwd + bwd at T = 4096 (run 157).
STAGED_REVERSE = True


def reverse_in_place(candidates: list, seq_chunks) -> list:
    """The d-states whose chunk-end cotangents ``rscan_kernel`` writes over their own
    per-chunk parts (``candidates``: those each of its programs owns whole, the template's
    ``in_place``): all of them on dense inputs, so that the reverse scan holds two
    per-chunk state buffers less for hla2 (fwd + bwd peak memory 3.12x -> 2.89x fla's,
    runs 73 / 74: issue 10's bar is 3x), at the price of a barrier a chunk; none for varlen,
    whose unowned chunk must read zero cotangents, not a part. ``REVERSE_IN_PLACE = False``
    turns it off (the A/B of the barrier's cost: 7-10 % of hla2's fwd + bwd across two
    leases, not yet measured in one process)."""
    return list(candidates) if REVERSE_IN_PLACE and seq_chunks is None else []


REVERSE_IN_PLACE = True


def narrow_ok(first, chained_dots: bool) -> bool:
    return first.dtype not in TENSOR_CORE_DTYPES or not chained_dots


def feature_blocks(program, common: dict) -> dict:
    """The B_<dim> tile widths of the program's feature dims (not the packed ones)."""
    return {f"B_{d}": common[f"B_{d}"] for d in program.algebra.dims}


def packed_blocks(program, common: dict) -> dict:
    """The B_<dim> tiles of the program's packed dims (the output and cotangent kernels
    loop over them: ``dot_override`` must see them)."""
    return {f"B_{pd.name}": common[f"B_{pd.name}"] for pd in program.packed}


def dot_override(first, chained_dots: bool, block: dict, features: dict | None = None) -> dict:
    """Chains of bf16/fp16 dots at a narrow chunk, block or feature dim run with fp32
    tiles: the Hopper miscompile of ``state_blocks`` also strikes at C = 32 (hla3 at
    d = 128 needs C = 32 to fit shared memory, and its bf16 state pass then faults)
    and at feature dims of 32 (hla2's output kernel at d = 32, once the precision plan
    sent its state products to bf16: an illegal address, examples/mqar.py, run 37).
    ``features``: ``feature_blocks`` of the launch."""
    chunk = first.shape[3]
    widths = list(block.values()) + list((features or {}).values())
    if chained_dots and first.dtype in TENSOR_CORE_DTYPES and (
            chunk < 64 or any(w < 64 for w in widths)):
        import triton.language as tl
        return {"DOT": tl.float32, "SDOT": tl.float32}
    return {}


# Launch options tried in order when a kernel needs more shared memory than the
# GPU has (large states at d = 128): the default software pipelining keeps
# several chunks' token tiles in flight; one stage keeps one.
FALLBACKS = ({}, {"num_stages": 1}, {"num_stages": 1, "num_warps": 8})
_WORKING: dict = {}    # (kernel, constexprs) -> the first fallback that compiled


def _fallback_key(kernel, args: dict) -> tuple:
    """What decides whether a launch fits the GPU: the kernel, its constexprs, warps and stages
    (strides and sizes do not change its shared memory, nor does a ``maxnreg`` cap). Runs on every launch: no
    sort, str() only for the odd non-number (tl dtypes)."""
    names = progress.constexpr_names(kernel)
    if names is not None:
        items = [(k, args.get(k)) for k in names + ("num_warps", "num_stages")]
    else:   # a kernel that does not list its constexprs: every non-tensor argument
        items = [(k, v) for k, v in args.items() if not isinstance(v, torch.Tensor)]
    return (id(kernel), tuple((k, v if v is None or isinstance(v, (int, float, str)) else str(v))
                              for k, v in items))


# Triton 3.6 on Hopper lays a [64, N] dot at 8 warps as two warpgroups of N / 2 columns, and
# with tf32 operands a warpgroup's N of 8 reads shared memory it did not pad, out of bounds
# (triton-lang/triton#10629): hla3's fp32 reverse pass narrowed to value blocks of 16 faulted
# (run 258, memcheck: an invalid __shared__ read in tl.dot) and ran at 4 warps (run 260). So
# a launch with tf32 dots and a tile (C, B_<dim>) narrower than this keeps 4 warps (0: off).
TF32_SPLIT_MIN_TILE = 32
TF32_PRECISIONS = ("tf32", "tf32x3")


def tf32_tiles(args: dict) -> bool:
    """Whether a launch's ``args`` (DOT, SDOT, PREC) run fp32 tiles through tf32 dots."""
    import triton.language as tl
    return args.get("PREC") in TF32_PRECISIONS and tl.float32 in (args.get("DOT"), args.get("SDOT"))


def wgmma_safe(args: dict) -> dict:
    """``args`` at 4 warps where 8 would split a tf32 dot's narrow tile (above), else as given."""
    if args.get("num_warps") != 8 or not tf32_tiles(args):
        return args
    tiles = [v for k, v in args.items() if (k == "C" or k.startswith("B_")) and type(v) is int]
    return {**args, "num_warps": 4} if min(tiles, default=TF32_SPLIT_MIN_TILE) < TF32_SPLIT_MIN_TILE else args


def with_fallback(args: dict, n: int) -> dict:
    """``args`` with FALLBACKS[n]'s launch options, through ``wgmma_safe`` (the last asks for 8 warps)."""
    return wgmma_safe({**args, **FALLBACKS[n]} if n else args)


def launch(kernel, grid, args: dict, may_fall_back: bool, tiling: Tiling | None = None) -> None:
    """``kernel[grid](**args)``; where ``may_fall_back`` (the caller fixed no stages),
    with the FALLBACKS on OutOfResources, or tuned under an autotuning session
    (``tiling``: the value-dim blocks the tuner may choose, from ``split_blocks``). A
    recorded call (``binding``) notes each launch that went through (a dry run, which only
    counts the variants a first call will compile, launches nothing and is not noted)."""
    args = wgmma_safe(args)
    if progress.dry_run():
        progress.record(kernel, args)
        return
    try:
        if _launch_variant(kernel, grid, args, may_fall_back, tiling):
            binding.launched(kernel, grid, args)
        else:
            binding.unbindable()
    except BaseException:
        binding.unbindable(raised=True)
        raise


def _launch_variant(kernel, grid, args: dict, may_fall_back: bool, tiling: Tiling | None) -> bool:
    """``launch``'s body; False where the launch was not the variant ``direct`` keys by
    ``args`` (a tuned launch)."""
    if may_fall_back and autotune.current() is not None and _tuned(kernel, grid, args, tiling):
        return False
    if direct.cached(kernel, grid, args):   # compiled before: no binding, key or bookkeeping
        return True
    if not may_fall_back:
        progress.first_launch(kernel, args, lambda: direct.call(kernel, grid, args))
        return True
    key = _fallback_key(kernel, args)
    start = _WORKING.get(key)
    if start is not None:   # this variant launched before: no progress bookkeeping per call
        direct.call(kernel, grid, with_fallback(args, start), key_args=args)
        return True
    from triton.runtime.errors import OutOfResources
    for n in range(len(FALLBACKS)):
        options = with_fallback(args, n)
        try:
            progress.first_launch(kernel, options,
                                  lambda a=options: direct.call(kernel, grid, a, key_args=args))
        except OutOfResources:
            if n == len(FALLBACKS) - 1:
                raise
            continue
        _WORKING[key] = n
        return True


# The forward's one-level scan stores the output's derived carries instead of the states the
# output reads only through them (triton_gen._derived_starts: HLA2's W0 = S C - G, not C, G).
DERIVED_STARTS = True
# A two-stage scan whose second stage walks the states (HLA3's) has ``derived_kernel`` form the
# output's derived carries at every chunk start (triton_gen._derived_kernel), the output kernel
# loading them. Measured (run 202, H100, B = 2, H = 16, bf16, HLA3's forward, off -> on): d = 128,
# T = 16k 26.56 -> 21.69 ms (its output kernel 10.5 -> 2.17 ms, the derived kernel 3.25);
# d = 64 3.806 -> 3.651 at 16k, 14.79 -> 14.26 at 64k.
DERIVED_KERNEL = True
DERIVED_BLOCK = None     # the derived kernel's value blocks (None: ``split_blocks``' rule; 64: 22.67 ms, 32: 24.71)

# A forward call with nothing to differentiate, or an autograd call's forward or backward, like
# an earlier one in all but its tensors' data, replays that call's launches (runtime.binding,
# op._BoundForward, op._BoundTrainingForward, op._BoundTrainingBackward).
BOUND_CALLS = True

# A forward under autograd (eager) runs at the backward's chunk and runs the backward's state
# pass, keeping its chunk starts and the deltas its reverse scan reads for the backward
# (triton_backward.keep_state_pass): the state pass runs once per fwd + bwd instead of twice, for
# those tensors' memory between the two. One layer's peak is no higher (the backward's
# recomputation held them too); a model holds every layer's at once (hla2: 1 KB per token and
# head at d = 64, 4 KB at d = 128, against 0.75 KB of bf16 q, k, v at d = 128).
KEEP_STATE_PASS = True

# A call with no state in or out (no initial_state, no final state, no cp_group) that runs generated
# kernels runs the carried form of its algebra where it has one whose kernels generate
# (``ir.carried``, ``op.carried_kernels_error``: each derived carry with a recursion a summary of
# its own, HLA2's W0 = S C - G): the same outputs, no cancelling carried state, so bf16 state
# products and fewer state bytes. H100, B = 2, H = 16, d = 64, bf16, same process (round 33, run
# 238): hla2 fwd + bwd 15.62 -> 7.74 ms at T = 65536 (fla 3.39), 4.10 -> 2.02 at 16k. Its gradient
# kernels at d = 128 need 8 warps on the H100 (``grad_warps``).
CARRY_DERIVED = True
# ... and where that form adds product summaries (a cross term reading several segment-B
# summaries: HLA3's Z0..Z2, ir.carried), only where this is on. H100, B = 2, H = 16, d = 64, bf16
# (round 35, run 243): hla3 forward 1.46 / 5.75 ms at T = 16k / 64k (as written 3.62 / 14.0 in
# run 203), fwd + bwd 8.26 at 16k (24.7 in run 220); bf16 gradients <= 7.1e-3 RMS of fp32 (run 242).
CARRY_PRODUCTS = True

# A call with no state in or out, of a program with an attention form (``ir.attention``: every
# surviving output term pairwise -- linear, power), may run that form: one kernel over (query
# chunk, key chunk) pairs, no chunk-start states (``use_attention_form``); differentiated, its
# backward too (two kernels, ``runtime.attention_backward``; the rule is the forward's).
# "auto": on CUDA where its multiply-adds are at most ATTENTION_MAC_RATIO x the chunk form's
# (``ir.attention.attention_macs`` / ``chunk_form_macs``: the algebra's products and, since round
# 48, the one-hot dots that pick a wide tile's packed power columns, 2x the state products of
# power p = 2 at d = 128 in each of its kernels): its dense [C, C] token products run nearer
# the tensor cores' peak than the chunk form's state products. H200, bf16, B = 2, H = 16, gated
# forward, attention form vs the chunk form (MAC ratio in brackets, by the algebra's count, which
# is the whole count but at d = 128; runs 292 at 3 stages, 291 at 2): power p = 2 at d = 64, T = 4k (1.45) 0.264 vs 0.815 ms, 16k (5.72) 3.47 vs 3.14, 64k (22.8)
# 55.3 vs 12.3; at d = 128, T = 4k (0.38) 0.371 vs 8.15, 16k (1.48) 5.19 vs 32.8, 64k (5.92)
# 82.5 vs 131.1 (with the column dots 0.13, 0.50, 1.99); p = 3 at d = 64, T = 16k (0.36) 3.82 vs 87.4 (2 stages); linear (ratio >= 10.8,
# 2 stages) 2.3-63x slower. MAC ratio over time ratio (how much more efficiently the attention
# form runs a MAC): linear 3.8 at d = 64 and 4.7 at d = 128 (T = 4k), power p = 2 5.2 at d = 64
# (16k); at d = 128 3.2 at 64k (ratio 1.99: 82.6 vs 131.3 ms) and 3.1 at 96k (2.98: 190.6 vs
# 196.5), normalised 4.1 at 64k (3.30: 84.7 vs 104.3; run 312). Before round 48 the count left
# out the column dots (d = 128 at 64k: ratio 5.92, efficiency 9.4) and kept that shape on the
# chunk form. 3.5 stays below all but d = 128's 3.1-3.2, so the form is taken where it should
# win save d = 128 between ~101k and the rule's 115k tokens (k = 1000 here; up to ~12 % slower
# there; 3.0 would instead give up to 40 % at d = 64 between 8.6k and 10k): gated power p = 2 up
# to T = 10k at d = 64 and 115k at d = 128 (normalised: 6.2k, 69k), p = 3 up to 158k at d = 64,
# linear up to 832 and 1280 tokens at d = 64 and 128. Training takes the forward's rule (the
# backward's kernels pick columns by dots at every width, uncounted): at d = 128, T = 64k the
# attention form trains in 537 ms where the chunk form's backward runs out of the H200's memory
# (B = 2, H = 16). Under an autotuning session "auto" times both forms instead, once per shape
# class (``Op._tuned_form``).
# "always": wherever the form exists (tests, A/B runs); "never".
ATTENTION_FORM = "auto"
ATTENTION_FORM_MODES = ("auto", "always", "never")
ATTENTION_MAC_RATIO = 3.5
ATTENTION_CHUNK = 64        # its query and key chunks
ATTENTION_WARPS = 4
# 3 pipeline stages: 5-12 % faster than 2 at every shape of run 292 (d = 128, T = 16k: 5.19 vs 5.78 ms)
ATTENTION_STAGES = 3
# its backward's two kernels (runtime.attention_backward). H200, power p = 2 gated, fwd + bwd, T = 16k
# (runs 296, 297): d = 64 at 2 stages 18.9 ms, 1 stage 20.5, 3 stages 18.2 (within noise), 8 warps 38.7;
# d = 128 at 2 stages 52.2 ms, 1 stage 33.4 (4k: 3.42 -> 2.44), 8 warps 46.7: its [C, 128] fp32
# accumulators (dk and dv) leave no registers for a second stage's buffers
ATTENTION_BWD_WARPS = 4
ATTENTION_BWD_STAGES = 2
ATTENTION_BWD_WIDE_STAGES = 1   # where a feature block is over 64 wide


def use_attention_form(program_at: Callable[[int], object], lengths, device) -> bool:
    """Does a stateless call over sequences of ``lengths`` tokens run the attention form
    (``ATTENTION_FORM``)? ``program_at(chunk)``: the call's chunk program at a chunk size."""
    from hladsl.ir.attention import attention_form, attention_macs
    if ATTENTION_FORM == "never" or (ATTENTION_FORM == "auto" and device.type != "cuda"):
        return False
    program = program_at(ATTENTION_CHUNK)
    form = attention_form(program)
    if form is None:
        return False
    if ATTENTION_FORM == "always":
        return True
    pairs = sum(attention_macs(form, program, n) for n in lengths)
    return pairs <= ATTENTION_MAC_RATIO * chunk_form_macs(program, lengths)


def chunk_form_macs(program: ChunkProgram, lengths: Sequence[int]) -> int:
    """The chunk form's forward multiply-adds over sequences of ``lengths`` tokens: the
    algebra's products (``ir.attention.chunk_macs``) and the one-hot dots that pick packed
    power columns (``triton_gen.column_pick_macs``), work its kernels run as surely."""
    from hladsl.ir.attention import chunk_macs
    picks = column_pick_macs(program)
    return sum(chunk_macs(program, n) + picks * -(-n // program.chunk) for n in lengths)


def attention_chunk(T: int, chunk_size: int | None, device) -> int:
    """The attention form's chunk: the op's, else ATTENTION_CHUNK (on CPU shrunk to the
    sequence, ``chunk_for``)."""
    return chunk_for(T, chunk_size or ATTENTION_CHUNK, device)


def attention_launch(program, first, chained_dots: bool, backward: bool = False) -> dict:
    """The attention kernel's constexprs and launch options (base dims only: it holds no
    packed state); fp32 tiles for its chain of dots where ``dot_override`` says (narrow
    chunks or feature dims, as for the output kernel's in-chunk terms). ``backward``: its
    backward's two gradient kernels'."""
    from hladsl.codegen.triton_gen import constexprs
    sizes = {d for d, _ in program.sizes}
    consts = {k: v for k, v in constexprs(program).items() if k == "C" or k[2:] in sizes}
    stages = ATTENTION_STAGES
    if backward:
        wide = max(v for k, v in consts.items() if k.startswith("B_")) > 64
        stages = ATTENTION_BWD_WIDE_STAGES if wide else ATTENTION_BWD_STAGES
    base = dict(DOT=dot_dtype(first.dtype, first.device), SDOT=state_dot_dtype(first.dtype, first.device),
                PREC=exact_precision(first.device), num_warps=ATTENTION_BWD_WARPS if backward else ATTENTION_WARPS,
                num_stages=stages, **consts)
    return {**base, **dot_override(first, chained_dots, {}, feature_blocks(program, consts))}   # (it may set DOT)


PLANS_KEPT = 256   # launch plans kept per cache before it starts over (shape classes in use)
_PLAN_CACHES: list[dict] = []   # every runner's plan cache (``switch`` forgets them all)


def plan_cache() -> dict:
    """A runner's cache of launch plans (for ``remembered``), registered so that changing a
    rule (``switch``) forgets the plans made under the old one."""
    cache: dict = {}
    _PLAN_CACHES.append(cache)
    return cache


def parse_value(text: str):
    """A rule constant's value from text: true / false, none, an int, a float, else the text."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def switches_from_env(text: str | None) -> dict:
    """``HLADSL_LAUNCH="NAME=VALUE ..."`` -> {NAME: value}, each checked (``SettingError``, a
    ValueError, naming the variable and the item otherwise)."""
    out = {}
    for item in (text or "").replace(",", " ").split():
        name, eq, value = item.partition("=")
        try:
            if not eq:
                raise ValueError("expected NAME=VALUE")
            out[name] = parse_value(value)
            check_switch(name, out[name])
        except ValueError as exc:
            raise SettingError(f"HLADSL_LAUNCH: {item}: {exc}") from None
    return out


def rule_constants() -> dict:
    """This module's scalar rule constants (what ``switch`` may set), by name."""
    return {k: v for k, v in vars(sys.modules[__name__]).items()
            if k.isupper() and isinstance(v, (bool, int, float, str, type(None)))}


def check_switch(name: str, value):
    """The current value of rule constant ``name``, after checking that ``value`` may
    replace it (ValueError naming the constant otherwise)."""
    rules = rule_constants()
    if name not in rules:
        raise ValueError(f"no launch rule constant '{name}'; expected one of {', '.join(sorted(rules))}")
    old = rules[name]
    if not (value is None or old is None or type(value) is type(old)
            or (type(old) is float and type(value) is int)):
        raise ValueError(f"launch.{name} is a {type(old).__name__}, got {value!r}")
    if old is None and not (value is None or (type(value) is int and value > 0)):   # the optional sizes and counts
        raise ValueError(f"launch.{name} takes a positive whole number or none, got {value!r}")
    if name in ("EXACT_DOTS", "EXACT_STATE_DOTS") and value not in EXACT_DOT_MODES:
        raise ValueError(f"launch.{name} is one of {', '.join(EXACT_DOT_MODES)}, got {value!r}")
    if name == "ATTENTION_FORM" and value not in ATTENTION_FORM_MODES:
        raise ValueError(f"launch.{name} is one of {', '.join(ATTENTION_FORM_MODES)}, got {value!r}")
    if name == "STAGE_PARTS" and value not in STAGE_PARTS_MODES:
        raise ValueError(f"launch.{name} is one of {', '.join(STAGE_PARTS_MODES)}, got {value!r}")
    return old


def switch(name: str, value):
    """Sets this module's rule constant ``name`` (e.g. ``REVERSE_IN_PLACE``) to ``value`` and
    forgets every launch plan made under the old value; returns the old value. For A/B
    timings in one process (``hladsl bench --launch NAME=VALUE``); the value must have the
    constant's type (an int for a float, or anything where the constant may be None)."""
    old = check_switch(name, value)
    setattr(sys.modules[__name__], name, value)
    forget_plans()
    return old


def forget_plans() -> None:
    """Forget every launch plan and bound call (made under the rules as they were)."""
    for cache in _PLAN_CACHES:
        cache.clear()


@contextlib.contextmanager
def switched(**rules):
    """Each rule constant ``switch``-ed to its value for the block, then back (A/B
    timings, tests); plans made under either value are forgotten at each switch."""
    old = {}
    try:
        for name, value in rules.items():
            old[name] = switch(name, value)
        yield
    finally:
        for name, value in reversed(old.items()):
            switch(name, value)


def remembered(cache: dict, key, build: Callable[[], object], cacheable: bool = True):
    """The launch plan of ``key`` in ``cache`` (what a call's launches need that does not
    depend on its tensors), built once; ``cacheable=False`` (varlen, explicit overrides)
    builds it for this call only. The cache starts over past PLANS_KEPT entries."""
    if not cacheable:
        return build()
    plan = cache.get(key)
    if plan is None:
        if len(cache) >= PLANS_KEPT:
            cache.clear()
        plan = cache[key] = build()
    return plan


@dataclass(frozen=True)
class TileMeta:
    """What the launch rules read of a token tile: a cached launch plan's Tiling holds
    this, not the tile (which would keep a call's input alive as long as the plan)."""
    dtype: torch.dtype
    device: torch.device
    shape: tuple


@dataclass(frozen=True)
class Tiling:
    """The value-dim blocks of a split grid a tuned launch may choose: B_<dim> ->
    widths to try, and ``retile(widths) -> (grid, block arguments)`` for a choice
    (the block arguments include the dot dtype the widths need)."""
    choices: dict[str, tuple[int, ...]]
    retile: Callable[[dict], tuple[tuple, dict]]
    sets: tuple[str, ...] = ("DOT", "SDOT")   # further arguments retile decides
    narrowable: tuple[str, ...] = ()           # the B_<dim> of split value dims (``narrower``)


def split_blocks(programs: int | tuple[int, ...], splits, program, common: dict, first, chained: bool,
                 width: int | None = None, fixed_blocks: bool = False,
                 scan: bool = False, warps: int | None = None,
                 states: tuple[str, ...] | None = None,
                 packed_tiles: dict | None = None) -> tuple[tuple, dict, Tiling]:
    """Grid (programs, blocks of each split dim), block arguments and the Tiling of a
    state-pass-like kernel (``programs`` a tuple: the leading grid axes, e.g. the delta
    kernel's (chunks, sequence·head)). A packed dim keeps its tile (common's B_); any other
    split dim takes ``width``, else ``STATE_BLOCK``, else ``state_blocks``' rule (seeing the
    packed dims' programs); the dot dtype follows ``dot_override``. The
    tuner may try other widths where the rule may narrow (``tune_widths``), unless
    ``fixed_blocks`` (the caller sizes buffers by the number of blocks). ``scan``: a scan
    kernel's walk, one program a SM where its value-free states are wide (``wide_value_free``).
    ``warps``: its warps, where not ``walker_options``' (the two-stage scan's ``stage_kernel``).
    ``states``: the states it holds, where not every streaming one (a stage of that scan).
    ``packed_tiles``: a packed dim's number of tiles where not D / B (row tiles)."""
    first = TileMeta(first.dtype, first.device, tuple(first.shape))   # retile must not pin the tensor
    sizes = dict(program.sizes)
    packed = {pd.name for pd in program.packed}
    narrow = narrow_ok(first, chained)
    lead = tuple(programs) if isinstance(programs, tuple) else (programs,)
    widths, n = {}, math.prod(lead)
    held_states = [s.name for s in program.algebra.streaming] if states is None else states
    one_per_sm = scan and wide_value_free(program, splits, held_states)
    packed_tiles = packed_tiles or {}

    def tiles_of(dim: str, width: int) -> int:
        return packed_tiles.get(dim) or -(-common[f"D_{dim}"] // width)
    for dim in splits:
        if dim in packed:
            widths[dim] = common[f"B_{dim}"]
            n *= tiles_of(dim, widths[dim])
    free = [dim for dim in splits if dim not in packed]
    width = width or STATE_BLOCK
    widths.update({dim: width for dim in free} if width else
                  state_blocks({dim: sizes[dim] for dim in free}, n, first.device, narrow, one_per_sm))
    widths = {dim: widths[dim] for dim in splits}   # grid axes in the kernel's order

    def retile(chosen: dict) -> tuple[tuple, dict]:
        block = {f"B_{d}": chosen.get(f"B_{d}", w) for d, w in widths.items()}
        blocks = tuple(tiles_of(d, block[f"B_{d}"]) for d in widths)
        if len(lead) + len(blocks) > 3:   # a grid has three axes: the kernel unfolds the split dims' blocks
            blocks = (math.prod(blocks),)
        grid = lead + blocks
        held = sum(math.prod(block.get(f"B_{d}", common.get(f"B_{d}", 1)) for d in program.state_dims(n))
                   for n in held_states)
        walker = walker_options(held) if warps is None else {"num_warps": warps}
        if "num_stages" in common:      # the caller fixed the stages
            walker.pop("num_stages", None)
        return grid, {**block, **walker,
                      **dot_override(first, chained, block, feature_blocks(program, common))}

    choices = {} if width or not narrow or fixed_blocks else {
        f"B_{d}": tune_widths(w, sizes[d]) for d, w in widths.items() if d not in packed}
    grid, block = retile({})
    return grid, block, Tiling(choices, retile, narrowable=tuple(f"B_{d}" for d in widths if d not in packed))


FLAT_SCAN_BLOCK = 1024   # state elements a program of a flat scan walks (8 a thread at 4 warps)


def flat_scan_blocks(walkers: int, program, states) -> tuple[tuple, dict, Tiling]:
    """Grid, block arguments and Tiling of a scan kernel that walks its states' flat layout
    (``triton_gen._chunk_scan``'s ``flat``: every update the state's decayed carry plus its
    own delta): (walkers, blocks of FLAT_SCAN_BLOCK elements of the largest state), 4 warps.
    Nothing to tune or narrow: the blocks hold no tile a dot needs."""
    largest = max(math.prod(program.state_shape(n)) for n in states)
    block = {"FLAT": min(FLAT_SCAN_BLOCK, block_size(largest)), "num_warps": 4}
    grid = (walkers, -(-largest // block["FLAT"]))
    return grid, block, Tiling({}, lambda chosen: (grid, block), sets=())


NARROWEST_SPLIT = 16   # tl.dot's minimum tile


def launch_narrowing(kernel, plan, attr: str, args: dict | Callable[[tuple], dict],
                     may_fall_back: bool, overrides: dict | None = None) -> tuple:
    """``launch`` of a split walking kernel whose (grid, block arguments, Tiling) is
    ``plan.<attr>`` (``split_blocks``); where no launch fallback fits at its width, the
    narrower blocks of ``narrower`` until one does, kept in the plan. ``args``: the
    arguments, or a function of the grid making them (buffers sized by the number of
    blocks: the reverse pass's per-block slots). ``overrides``: launch arguments given
    last. Returns the grid that ran. A width that fit no fallback is remembered per
    kernel and constexprs (``_TOO_WIDE``): plans that are not kept (varlen calls) start
    narrowing without launching it again."""
    from triton.runtime.errors import OutOfResources
    while True:
        grid, block, tiling = getattr(plan, attr)
        given = args(grid) if callable(args) else args
        full = {**given, **block, **(overrides or {})}
        key = _fallback_key(kernel, full)
        try:
            if key in _TOO_WIDE:
                raise OutOfResources(0, 0, "shared memory (remembered)")
            launch(kernel, grid, full, may_fall_back, tiling)
            return grid
        except OutOfResources:
            _TOO_WIDE.add(key)
            smaller = narrower(getattr(plan, attr))
            if smaller is None:
                raise
            setattr(plan, attr, smaller)


_TOO_WIDE: set = set()   # _fallback_key of split walking launches no fallback fitted


def narrower(launched: tuple[tuple, dict, Tiling]) -> tuple[tuple, dict, Tiling] | None:
    """The launch of a split walking kernel (``split_blocks``) with its first value-dim
    block that can be halved, halved, or None. For a kernel that needs more shared
    memory than the GPU has at every launch fallback (state and reverse passes): more
    programs, each holding less
    (HLA2's reverse pass at d = 128 needs 262144 B at full width, 131072 B at half, 1
    stage; the H100 has 232448). Below 64 ``dot_override`` makes chained bf16 dots fp32."""
    grid, block, tiling = launched
    for name in tiling.narrowable:
        if block[name] // 2 >= NARROWEST_SPLIT:
            widths = {n: block[n] for n in tiling.narrowable}
            widths[name] //= 2
            base = tiling.retile
            # the narrowed widths become the defaults: a tuned launch (``_tuned`` retiles
            # with its choices only) must not go back to the width that did not fit
            narrowed = Tiling({k: v for k, v in tiling.choices.items() if k not in widths},
                              lambda chosen: base({**widths, **chosen}), tiling.sets, tiling.narrowable)
            grid, block = narrowed.retile({})
            return grid, block, narrowed
    return None


WALKER_ELEMENTS_PER_4_WARPS = 8192


def walker_warps(elements: int) -> int:
    """Warps of a state-pass / reverse-pass program holding ``elements`` fp32 state
    elements in registers: 4, or 8 beyond WALKER_ELEMENTS_PER_4_WARPS (64 registers a
    thread at 4 warps), where 4 warps spill. Measured on the H100 (benchmarks/kernel_sweep.py,
    B = 2, H = 16, T = 4096, d = dv = 64): hla2 (12288) state pass 657 -> 531 µs, reverse
    1387 -> 1027 µs at 8 warps; ahla (8192) is faster at 4 (144 vs 206 µs)."""
    return 8 if elements > WALKER_ELEMENTS_PER_4_WARPS else 4


WALKER_STAGES = 4


def walker_options(elements: int) -> dict:
    """Launch options of a walking program: ``walker_warps``, and for the small states
    (4 warps) WALKER_STAGES pipeline stages, which keep the next chunks' token tiles in
    flight while one chunk's dot runs: linear's state and reverse passes 47 -> 39.5 µs
    (H100, B = 2, H = 16, T = 4096, d = 64; Triton's default is 3). Where they do not fit
    shared memory, ``launch``'s fallbacks take one stage."""
    warps = walker_warps(elements)
    return {"num_warps": warps, **({"num_stages": WALKER_STAGES} if warps == 4 else {})}


# Autotuning candidates (runtime.autotune times each; OutOfResources skips one).
# Warps: 4 is the default, 8 halves the registers a thread holds (the wide
# states). Stages: 1 keeps one chunk's tiles in shared memory, 2-3 pipeline the
# token loads of the chunk loops.
TUNE_WARPS = (4, 8)
TUNE_STAGES = (1, 2, 3)


def tune_widths(default: int, size: int) -> tuple[int, ...]:
    """Value-dim blocks a tuned state / reverse pass tries: the rule's width, half
    and double it, within [16, the padded dim]: narrower means more programs (fill
    the GPU), wider fewer re-reads of the token tiles."""
    return tuple(w for w in (default // 2, default, default * 2) if 16 <= w <= block_size(size))


def tune_candidates(tiling: Tiling | None) -> list[dict]:
    """Every launch config a tuned launch times: warps x stages x block widths."""
    blocks = [{}]
    for name, widths in (tiling.choices.items() if tiling else ()):
        blocks = [{**b, name: w} for b in blocks for w in widths]
    return [{"num_warps": w, "num_stages": s, **b}
            for b in blocks for w in TUNE_WARPS for s in TUNE_STAGES]


def _tuned(kernel, grid, args: dict, tiling: Tiling | None) -> bool:
    """Launch with the tuned config of this launch's shape class (timed now if it is
    new); False when tuning cannot be done (no memory for scratch copies, a stale
    winner that no longer fits): the caller then uses the heuristics."""
    from triton.runtime.errors import OutOfResources
    tuning = autotune.current()
    decided = {"num_warps", "num_stages"} | (set(tiling.choices) | set(tiling.sets) if tiling else set())
    names = progress.constexpr_names(kernel) or tuple(
        k for k, v in args.items() if not isinstance(v, torch.Tensor))
    key = {"kernel": autotune.kernel_source(kernel), **tuning.shape,
           "constexprs": {n: str(args[n]) for n in names if n in args and n not in decided},
           **({"maxnreg": args["maxnreg"]} if args.get("maxnreg") else {})}   # a cap: winners of its own

    def configured(candidate: dict, tensors: dict) -> tuple[tuple, dict]:
        blocks = {k: v for k, v in candidate.items() if k not in ("num_warps", "num_stages")}
        g, block = tiling.retile(blocks) if tiling else (grid, {})
        return g, wgmma_safe({**args, **block, **tensors, "num_warps": candidate["num_warps"],
                              "num_stages": candidate["num_stages"]})

    fast = (id(kernel), tuning.shape_text, grid,
            tuple((k, str(v)) for k, v in args.items() if not isinstance(v, torch.Tensor)))
    winner = tuning.tuner.lookup(key, fast)
    if winner is None:
        candidates = tune_candidates(tiling)
        try:
            scratch = autotune.scratch_copies(args)
        except torch.cuda.OutOfMemoryError:
            return False

        def trial(candidate):
            g, options = configured(candidate, scratch)
            progress.first_launch(kernel, options, lambda: kernel[g](**options))
        winner = tuning.tuner.tune(key, candidates, trial,
                                   progress.tuning_line(kernel, len(candidates)))
        del scratch
    g, options = configured(winner, {})
    try:
        progress.first_launch(kernel, options, lambda: kernel[g](**options))
    except OutOfResources:
        return False
    return True


GRAD_TARGETS_PER_PROGRAM = 1


def grad_target_sets(groups: int, per_program: int | None = None) -> list[int]:
    """The TARGETS bitmasks of the gradient kernel's launches: consecutive runs of
    ``per_program`` of its ``groups`` target groups (token inputs, then Λ). One per
    program by default: a program computing every target holds each one's [C, dim]
    fp32 accumulator and network tiles at once and spills (linear at d = 64: 1600
    bytes of stack on sm_90; one target per program: none), while recomputing the
    products targets share (Q Kᵀ, the decay mask) costs only tensor-core FLOPs."""
    per = GRAD_TARGETS_PER_PROGRAM if per_program is None else per_program
    if per < 1:
        raise ValueError(f"targets_per_program must be >= 1, got {per_program}")
    return [((1 << min(per, groups - g)) - 1) << g for g in range(0, groups, per)]


GRAD_WHOLE_MAX_MATMULS = 48        # a group whole up to this many full-width matmuls (4 until round 30)
GRAD_WHOLE_MAX_SPILL = 1024        # ... and whole, or in runs of GRAD_LONG_RUN, while its kernels spill at most this
GRAD_LONG_RUN = 8                  # longer runs, tried before GRAD_NETWORKS_PER_PROGRAM's (0: none; round 37)
GRAD_NETWORKS_PER_PROGRAM = 4      # the runs taken untried (runs of 2 until round 12)


def grad_parts(networks: int, matmuls: int) -> tuple[int, ...]:
    """How many programs may share one gradient target's ``networks``, fewest first: the
    launcher takes the first whose kernels keep at most GRAD_WHOLE_MAX_SPILL bytes a thread
    in local memory (``grad_fitting_parts``), the last without a trial. Where the group's
    code (its networks reusing each other's products) has at most GRAD_WHOLE_MAX_MATMULS
    full-width matmuls: whole (one program) and contiguous runs of GRAD_LONG_RUN and of
    GRAD_NETWORKS_PER_PROGRAM networks, fewest parts first (a count met twice once); a larger
    group runs in runs of GRAD_NETWORKS_PER_PROGRAM untried (its trial compiles cost minutes:
    hla3 as written with a state, whose dq and dk have 70 and 84 matmuls, overran a test's
    480 s timeout compiling its trial runs, run 252). Each run computes the products its networks read
    (once, shared among them: ``triton_bwd._parted_code``), their partial gradients summed
    afterwards (one more [C, dim] fp32 write and read each).

    ``networks`` counts a group's units (a dΛ network riding with a gradient joins its unit:
    ``triton_bwd._network_units``). Why (H100, B = 2, H = 16, d = 64, bf16, fwd + bwd, ms; runs
    211-217, local bytes as the driver reports them there; the dΛ groups named below held every
    dΛ network then, before round 36 put them in their inputs' groups): runs recompute what their networks share -- each run of
    hla3_masked's dq needs 24-30 of the group's 47 matmuls, 162 over its six runs -- so a
    whole group wins wherever it spills little: ungated hla3_masked 6.19 -> 4.26 at 16k,
    23.94 -> 16.53 at 64k (dq, dk whole: 424, 496 B); ahla 3.10 -> 2.53, gated 4.08 -> 3.69
    (at most 624 B); gated linear's dΛ 2.81 -> 1.80 (0 B); ungated hla2 4.72 -> 4.52 (at
    most 240 B; in round 12, before runs shared products, whole lost there). Where it spills
    about 2 KB it loses: gated hla3_masked 9.42 -> 10.71 with dq, dk whole (1800, 2288 B),
    15.77 with its dΛ whole too; gated hla2 6.97 -> 8.97 with every group whole (its dΛ
    2016 B; dq, dk 720, 256 B: 7.05 whole with dΛ in runs); hla3's dv whole (33 matmuls;
    2016 B on sm_90 by ``benchmarks/compile_probe.py --only grad_kernel``) 7.47 -> 8.36 at
    4k. The same holds between run lengths (H200, round 37, run 250, fwd + bwd at 16k):
    ungated hla3's dq, dk (carried form, 29 and 33 units) spill 1792, 1912 B whole, at most 824 B in
    runs of 8 and run 6.996 -> 6.156 ms in runs of 8 against runs of 4; gated, runs of 8
    spill up to 1824 B and lost 5 % (run 246). Spills are the compiler's to decide (the
    groups' live tiles do not separate these cases), so the rule compiles a candidate's
    kernels before their first launch and reads them. GRAD_WHOLE_MAX_MATMULS bounds the
    trial compiles: hla3's dq, dk as written (70, 84 matmuls) spill 3856, 4648 B whole
    on sm_90 and take 29-33 s to compile on a 2-core CPU."""
    def runs(length: int) -> int:
        return max(1, -(-networks // length))
    if matmuls > GRAD_WHOLE_MAX_MATMULS:   # no trial compiles of so large a group's kernels
        return (runs(GRAD_NETWORKS_PER_PROGRAM),)
    return tuple(sorted({1} | {runs(n) for n in (GRAD_LONG_RUN, GRAD_NETWORKS_PER_PROGRAM) if n}))


_SPILLS: dict = {}   # a gradient kernel's compiled variant (direct.variant_key) -> its local bytes a thread
_GRAD_PARTS = plan_cache()   # (a launch's whole variant, its candidates) -> the part count it runs in


def part_lam(part: int, lam_first: int) -> int:
    """The LAM constexpr of part ``part`` of a gradient launch whose first part has ``lam_first``
    (0: adds nothing to dΛ; 1: stores it; 2: adds): later parts add to what part 0 wrote."""
    return lam_first if part == 0 else 2 * bool(lam_first)


def grad_fitting_parts(kernel, grid, in_parts, candidates: tuple[int, ...], lam_first: int) -> int:
    """The first of ``candidates`` (``grad_parts``: part counts, fewest first) none of whose
    parts' kernels keeps more than GRAD_WHOLE_MAX_SPILL bytes a thread in local memory
    (``grad_spills``; a candidate's parts are tried in order, up to the first that spills);
    the last one untried where none fits. ``in_parts(parts)``: the launch's arguments in that
    many parts but PART, PARTS, LAM (``part_lam``) -- each trial compiles the variant it would
    launch. Remembered per launch variant, so a call after the first builds one variant key;
    the first of ``candidates`` where nothing is known (the interpreter) or, in a dry run
    (``progress.counted``), as far as nothing new would compile."""
    if len(candidates) == 1:
        return candidates[0]
    key = compiled_variant_key(kernel, {**in_parts(1), "PART": 0, "PARTS": 1, "LAM": lam_first})
    if key is None:
        return candidates[0]
    known = _GRAD_PARTS.get((key, candidates))
    if known is not None:
        return known
    chosen = candidates[-1]
    for parts in candidates[:-1]:
        args = in_parts(parts)
        if not any(grad_spills(kernel, grid, {**args, "PART": p, "PARTS": parts, "LAM": part_lam(p, lam_first)})
                   for p in range(parts)):
            chosen = parts
            break
    if not progress.dry_run():
        _GRAD_PARTS[(key, candidates)] = chosen
    return chosen


def grad_spills(kernel, grid, args: dict) -> bool:
    """Whether the gradient kernel launched with ``args`` would keep more than
    GRAD_WHOLE_MAX_SPILL bytes a thread in local memory (``local_bytes``: compiled, not
    launched, once per compiled variant -- so every call of a shape runs the same programs and
    sums in the same order); False where that is not known (the interpreter) and, in a dry
    run (``progress.counted``), for a variant not compiled yet. An autotuning session's
    launch options may differ from the default ones the verdict was compiled with."""
    key = compiled_variant_key(kernel, args)
    if key is None:
        return False
    spilled = _SPILLS.get(key)
    if spilled is None:
        if progress.dry_run():   # counting a first call's compiles: nothing compiles yet
            return False
        spilled = _SPILLS[key] = local_bytes(kernel, grid, args)
    return spilled > GRAD_WHOLE_MAX_SPILL


def compiled_variant_key(kernel, args: dict) -> tuple | None:
    """``direct.variant_key`` of a GPU kernel's launch; None under the interpreter."""
    from hladsl.runtime import direct
    return direct.variant_key(kernel, args) if direct.launches_on_gpu(kernel) else None


def local_bytes(kernel, grid, args: dict) -> float:
    """Local memory (spills, stack) a thread of ``kernel``'s variant for ``args`` keeps, in
    bytes: compiled for the GPU without a launch, with the first of FALLBACKS that fits its
    shared memory (as ``launch`` would run it); infinite where none fits."""
    from triton.runtime.errors import OutOfResources
    for n in range(len(FALLBACKS)):
        options, compiled = with_fallback(args, n), []
        progress.first_launch(kernel, options, lambda: compiled.append(kernel.warmup(grid=grid, **options)))
        try:
            compiled[0]._init_handles()   # loads the binary: the driver reports its local memory
        except OutOfResources:
            continue
        return 4 * compiled[0].n_spills   # Triton counts 4-byte words
    return math.inf


GRAD_WARPS = None     # the gradient kernels' warps whatever the rule says (an A/B knob: None keeps it)
# ptxas' register cap a thread for the gradient kernels (an A/B knob; None: no cap). Declined as a rule (run 271,
# H200, hla3 ungated, B = 2, T = 16384, H = 16, d = 64, bf16, fwd + bwd): 6.18 ms uncapped (2 programs of 4 warps
# an SM), 8.06 at 168 (3 programs; its runs of 8 spill past GRAD_WHOLE_MAX_SPILL, so runs of 4), 8.58 at 168 in
# runs of 8 (sm_90 stack <= 1256 B a thread), 10.99 at 128 (4 programs, <= 1912 B): the spills cost more than
# the warps they let in hide.
GRAD_MAXNREG = None
WIDE_GRAD_DIM = 128
WIDE_GRAD_WARPS = 8


def grad_warps(features: dict, tf32: bool = False) -> dict:
    """The gradient kernel's warps where they differ from the call's (4): 8 where a feature
    dim is at least WIDE_GRAD_DIM (``features``: ``feature_blocks``), as the forward's output
    kernel (``output_warps``), and where the call's token tiles are fp32 with tf32 dots
    (``tf32``: ``tf32_tiles`` of the call). Why: at 4 warps Triton 3.6 miscompiles the bf16 dot chains of
    hla2's carried form (``ir.carried``) at d = 128 on the H100 -- its dv group, four networks
    whole, C = 64, faults with a misaligned 8-byte shared-memory store inside a ``tl.dot``
    (compute-sanitizer, runs 231-237); at 8 warps it runs (run 239, gated and ungated, d = 64
    and 128), as it does with one or two networks a program. Likewise gated ahla with fp32
    inputs (H200, B = 1, T = 1024, H = 2): its TARGETS = 4 kernel, whole, C = 64, tf32x3 dots,
    writes shared memory out of bounds inside a ``tl.dot`` at 4 warps (memcheck, run 263) and
    runs at 8. (``wgmma_safe`` still takes a launch with a tile under 32 back to 4 warps.) With
    ``GRAD_MAXNREG``, ptxas' register cap too."""
    cap = {"maxnreg": GRAD_MAXNREG} if GRAD_MAXNREG else {}
    if GRAD_WARPS:
        return {"num_warps": GRAD_WARPS, **cap}
    if WIDE_GRAD_WARPS and (tf32 or max(features.values(), default=0) >= WIDE_GRAD_DIM):
        return {"num_warps": WIDE_GRAD_WARPS, **cap}
    return cap


GRAD_LOOP_TILE_ELEMENTS = 4096


def grad_loop_tile(chunk: int, width: int) -> int:
    """The gradient kernel's tile of the packed dim it loops over: at most ``width``
    (the forward's), narrowed until a [C, tile] fp32 tile is at most
    GRAD_LOOP_TILE_ELEMENTS (32 registers a thread at 4 warps), not below 16 (tl.dot's
    minimum). Round 4 chose 1024 by sm_90 stack bytes (power p = 2, d = 64, C = 64, the
    factors then gathered from memory: tile 64 spilled 2064 bytes, 16 none). Since the
    factors are picked from the loaded token tile by one-hot dots (``triton_gen.slot_columns``)
    the loop holds more dots, and below 64 ``dot_override`` runs them fp32 (the kernel has
    chained dots anyway: its intra-chunk products); the narrow loop's small fp32 dots cost
    more than the spills. Measured (run 170, H100, power p = 2 gated, B = 2, H = 16, d = 64,
    bf16, fwd + bwd, the selections not yet counted as chains): tile 16 (1024) 60.17 ms at
    T = 4k, 235.4 at 16k; 32 (2048) 99.65, 396.4; 64 (4096) 5.481, 21.97; as chains at 64
    (run 171) 5.51, 21.78 (``retention`` 7.957, 28.34)."""
    tile = width
    while tile > 16 and chunk * tile > GRAD_LOOP_TILE_ELEMENTS:
        tile //= 2
    return tile


# The query scale (a call's ``scale``, d^-0.5 by default) is applied by the chunk kernels as
# they load a query tile (True: scl_<x>, rounded to the input dtype: for bf16 / fp16 the
# bits of torch's x * scale, tests/gpu/test_gpu_kernel_io.py; for fp32 the compiler may fuse
# the product into the next FMA) or by torch before them (False: one more pass over q, read and written, in the
# forward and again in the backward). Measured (runs 75, 76, H100, B = 2, H = 16, d = 64,
# bf16): the torch multiply was 175 µs of linear's 1.25 ms forward at T = 65536; linear's
# forward went 1.42x -> 1.22x fla there.
SCALE_QUERIES_IN_KERNEL = True


STEP_MAX_TOKENS = 64


STEP_ELEMENTS_PER_WARP = 3200
STEP_SHARED_ELEMENTS_PER_WARP = 4096


def step_warps(elements: int, shared: bool = False) -> int:
    """4, 8 or 16 warps, about STEP_ELEMENTS_PER_WARP fp32 state elements a warp
    (STEP_SHARED_ELEMENTS_PER_WARP in a shared split's value blocks). Fewer warps
    measured faster wherever they differ: run 27 (H100, B = 64, H = 16, d = dv = 64,
    whole kernels) ahla (8192 elements) 1.36 of copy bandwidth at 4 warps, 0.97 at 8;
    hla2 and hla3_masked (12288) 0.57 and 0.50 at 4, 0.46 at 8; hla3 (24576) 0.40 at
    8, 0.32 at 16. Run 106, the shared split's blocks of 32: hla3 (16384 elements)
    108.1 µs at 4 warps vs 158.3 at 8 (255 registers a thread: two programs an SM at
    4 warps, one at 8), hla2 41.9 vs 50.0, hla3_masked 43.2 vs 53.3 (8192). Decode is
    latency-bound: more programs an SM keep more loads in flight."""
    per_warp = STEP_SHARED_ELEMENTS_PER_WARP if shared else STEP_ELEMENTS_PER_WARP
    warps = 4
    while warps < 16 and elements > warps * per_warp:
        warps *= 2
    return warps


# Specs with value-free states (HLA2's S, HLA3's SK and SQ, normalizer states): the bridged
# split where it applies (step_plan.bridge_split), else the shared split (one launch).
# Run 117 (H100, B = 64, H = 16, d = dv = 64, one gated token, graph of 16): bridged
# hla2 40.1 µs vs shared 42.5, hla3 92.5 vs 116.7, hla3_masked 39.2 vs 40.3.
STEP_BRIDGED = True
STEP_BRIDGED_BLOCK = 32  # value_kernel's value block (None: whole; run 117: hla3 53.9 µs vs 73.9 whole)
STEP_SHARED_BLOCK = 32   # the shared split's value block (None: whole)
STEP_FREE_ROWS = 4096    # packed rows a block of the shared split's last-block update (run 106)
STEP_FREE_WARPS = None   # free_kernel's warps (None: step_free_warps' rule)


def step_free_warps(elements: int) -> int:
    """Warps of the bridged split's free_kernel, which holds the value-free states whole
    (``elements`` fp32) with their new values: 8 for one [64, 64] tile, else 4. Run 117
    (H100, B = 64, H = 16, d = 64, the kernel alone): HLA2's S (4096) 14.6 µs at 4 warps,
    11.1 at 8, 12.1 at 16 (123 registers a thread at 8: two programs an SM); HLA3's SK
    and SQ (8192) 26.1 at 4, 30.0 at 8, 34.6 at 16 (202 registers at 8: one program an
    SM; 255 and a small spill at 4, two); vectors (normalizers alone) need no more than 4."""
    return STEP_FREE_WARPS or (8 if 4096 <= elements < 8192 else 4)


def step_value_block(size: int, splittable: bool, shared: bool, bridged: bool = False) -> int:
    """The decode step's block of the value dim (padded ``size`` when unsplit).
    Specs whose states all hold the value dim (linear, ahla, power) run whole:
    one program per (row, head) reaches 0.85-1.14 of copy bandwidth on the H100
    at d = dv = 64 (run 27; in run 27's sweep 16-wide blocks were slower than whole
    for every spec that splits: linear 0.75 vs 0.94, ahla 0.84 vs 1.31, power p = 2
    0.67 vs 1.08). Specs with value-free states hold more: one program holding every
    state (up to 24576 fp32 at d = dv = 64: one or two programs an SM) reached only
    0.40-0.55. The bridged split's value_kernel (``bridged``) holds only the states
    with the value dim, in blocks of STEP_BRIDGED_BLOCK (a 32-wide fp32 row is one
    128-byte line; run 117, hla3's P and G1..G3: 53.9 µs at 32, 73.9 whole). The shared
    split (``shared``, where the bridged one does not apply) runs blocks of
    STEP_SHARED_BLOCK that also read the value-free states: run 106, hla2 41.9 µs vs
    54.1 whole, hla3_masked 43.2 vs 55.4, hla3 108.1 vs 141.7; 16-wide blocks were
    slower (58.6, 56.4, 166.8), as was the former phase split (a second launch
    re-reading and re-gathering the value-free states; run 33: hla2 0.43)."""
    width = block_size(size)
    if bridged:
        return min(width, STEP_BRIDGED_BLOCK or width)
    if shared and not splittable and STEP_SHARED_BLOCK:
        return min(width, STEP_SHARED_BLOCK)
    return width


for _name, _value in switches_from_env(os.environ.get("HLADSL_LAUNCH")).items():
    setattr(sys.modules[__name__], _name, _value)
