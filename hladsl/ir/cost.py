"""Cost model of the chunk kernels: FLOPs and HBM bytes per token of each
kernel of the two-pass schedule, read off the chunk program's contraction plans
(and the backward program's), before the kernels share subexpressions; and of the
forward's chunk-parallel state pass (``scan_costs``: schedule "scan", in one stage or
two), whose kernels trade the walk's token work for per-chunk buffers in HBM.

FLOPs are 2 × the planned multiply-adds (elementwise steps count once each);
bytes count what a kernel must move through HBM at least once per chunk: the
token tiles it reads (``token_bytes`` each element), the cumulative gates, the
chunk-start states it writes or reads (fp32), the output it writes and the token
gradients (in the tokens' dtype, as the kernels write them). Benchmarks divide these by measured
times for achieved TFLOP/s and GB/s.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

from hladsl.ir.backward import BackwardProgram, output_size
from hladsl.ir.chunk import ChunkProgram, poly_sizes
from hladsl.ir.contract import plan
from hladsl.ir.operands import Kind
from hladsl.ir.recursion import chunk_terms, recursion
from hladsl.ir.scan import has_chunk_scan, scan_plan, split_complete_scan, staged_scan

FP32 = 4


@dataclass(frozen=True)
class KernelCost:
    kernel: str
    flops_per_token: float
    bytes_per_token: float
    what: str

    @property
    def intensity(self) -> float:
        """FLOPs per byte."""
        return self.flops_per_token / self.bytes_per_token if self.bytes_per_token else 0.0


def derived_macs(program: ChunkProgram) -> int:
    """Multiply-adds per chunk of the derived carries (sums of carried-state products)."""
    return sum(_poly_macs(program, d.poly, d.poly.free) for d in program.derived)


def _poly_macs(program: ChunkProgram, poly, free) -> int:
    """Multiply-adds of a sum of products of state tiles (a derived carry, a recursion's terms)."""
    dims = dict(program.sizes)
    total = 0
    for m in poly.terms:
        index = {i: dims[s] for f in m.factors for i, s in zip(f.indices, program.algebra.summary(f.name).dims)}
        total += plan(tuple(f.indices for f in m.factors), free, tuple(sorted(index.items()))).flops
    return total


def _inputs(terms) -> set[str]:
    return {o.name for t in terms for o in t.operands if o.kind in (Kind.TOKEN, Kind.POWER)}


def _carried(terms) -> set[str]:
    return {o.name for t in terms for o in t.operands if o.kind is Kind.CARRY}


def kernel_costs(program: ChunkProgram, backward: BackwardProgram | None = None,
                 token_bytes: int = 2) -> list[KernelCost]:
    alg, C = program.algebra, program.chunk
    dims = dict(program.sizes)
    lam = FP32 * C if program.gated else 0

    def tokens(names) -> int:
        return sum(C * dims[alg.inputs[n]] for n in names) * token_bytes

    def states(names) -> int:
        return sum(prod(program.state_shape(n)) for n in names) * FP32

    out_terms = program.output + program.normalizer
    state_terms = tuple(t for _, ts in program.states for t in ts)
    read = _carried(out_terms) | program.derived_reads()
    flops = program.flops()
    o_bytes = C * output_size(program) * token_bytes
    rows = [
        KernelCost("state_pass", 2 * flops["state"] / C,
                   (tokens(_inputs(state_terms)) + lam + states(read)) / C,
                   "state terms; writes the chunk-start states the outputs read"),
        KernelCost("output", 2 * (flops["output"] + derived_macs(program)) / C,
                   (tokens(_inputs(out_terms)) + lam + states(read) + o_bytes) / C,
                   "derived carries and output terms; reads chunk-start states, writes o"),
    ]
    if backward is not None:
        b = backward.flops()
        every = set(alg.inputs)
        d_states = states(n for n, _ in program.states)
        rows += [
            KernelCost("reverse", 2 * b["reverse"] / C,
                       (tokens(every) + lam + o_bytes + states(read) + d_states) / C,
                       "d-state pass: reads dO and starts, writes d(end state) per chunk"),
            KernelCost("gradient", 2 * b["gradient"] / C,
                       (tokens(every) + lam + o_bytes + states(read) + d_states
                        + tokens(every) + lam) / C,
                       "token and Λ gradients: reads dO, starts and d-states, writes d tokens"),
        ]
    return rows


def scan_costs(program: ChunkProgram, token_bytes: int = 2, two_stages: bool = False,
               walked: tuple[str, ...] = (), derived_kernel: bool = False) -> list[KernelCost]:
    """The forward's state pass as a chunk scan (``ir.scan``; schedule "scan": one stage, or
    two where the program's scan has only two, HLA3's) or, with ``two_stages``, a complete
    scan split in two (``staged_scan(complete=True)``; schedule "staged"): per kernel, FLOPs
    and HBM bytes per token as ``kernel_costs`` counts them. Its sequential kernels' FLOPs
    are what one program per (sequence, head) walks chunk after chunk. Empty where the
    program has no such scan. The output kernel is ``kernel_costs``', except where the scan
    carries derived carries by their recursion (``walked``, what the codegen decides with the
    kernels' splits: ``codegen.triton_gen._derived_recursion`` in one stage, ``_staged_recursion``
    in two) instead of the states they drop: the rows are then those kernels' -- in one stage
    the recursion's products for the dropped states' updates and W's starts stored; in two, the
    stage kernel's chunk terms (``ir.recursion.chunk_terms``), the walk of W and a first stage
    storing only the starts something reads -- and an "output" row of their own (no derived
    carry formed, W's starts read). ``derived_kernel``: a second stage that walks the states is
    followed by ``derived_kernel`` forming the derived carries from every start (what the codegen
    and the launch rule decide: ``codegen.triton_gen._derived_kernel``), with the output row
    reading them. Starts count as fp32 (the kernels store some in bf16)."""
    plan_ = scan_plan(program)
    if two_stages:
        staged = split_complete_scan(program, plan_)
        if staged is None:
            return []
    else:
        staged = staged_scan(program, plan_)
        if staged is None and not has_chunk_scan(program, plan_):
            return []
    alg, C = program.algebra, program.chunk
    dims = dict(program.sizes)
    lam = FP32 * C if program.gated else 0
    role = {(t.state, t.index): t for t in plan_.terms}

    def tokens(terms) -> int:
        return sum(C * dims[alg.inputs[n]] for n in _inputs(terms)) * token_bytes

    def states(names) -> int:
        return sum(prod(program.state_shape(n)) for n in names) * FP32

    def terms_of(names, roles):
        return [t for name, ts in program.states if name in names
                for k, t in enumerate(ts) if role[(name, k)].role in roles]

    out_terms = program.output + program.normalizer
    read = _carried(out_terms) | program.derived_reads()
    names = [n for n, _ in program.states]
    lower = list(staged.lower) if staged else names
    first = terms_of(lower, ("delta",))
    aux = plan_.aux if staged is None else ()
    grown = {t.state for t in plan_.terms if t.state in lower and t.role in ("delta", "scan")}
    summaries = states(grown) + sum(prod(dims[d] for d in a.dims) for a in aux) * FP32
    rows = [KernelCost("delta", 2 * (sum(t.plan.flops for t in first) + sum(a.term.plan.flops for a in aux)) / C,
                       (tokens(first + [a.term for a in aux]) + lam + summaries) / C,
                       "every chunk's deltas at once" + (" and summaries no state holds" if aux else "")),
            KernelCost("scan", 2 * (0 if staged else plan_.scan_macs) / C,
                       (summaries + states(n for n in lower if n in read or (staged and n in staged.reads))) / C,
                       "sequential: reads the deltas, writes the chunk-start states")]
    if staged and walked:
        return rows[:1] + _derived_walk(program, staged, walked, summaries, tokens, states, lam, token_bytes)
    if walked:
        recs = _recursions(program, walked)
        dropped = {r.dropped for r in recs}
        kept = plan_.scan_macs - sum(t.macs for t in plan_.terms if t.state in dropped and t.role == "scan")
        products = sum(_poly_macs(program, r.terms, r.free) for r in recs)
        direct = _carried(out_terms)
        return rows[:1] + [
            KernelCost("scan", 2 * (kept + products) / C,
                       (summaries + states(n for n in names if n in direct) + _w_bytes(program, walked)) / C,
                       "sequential: reads the deltas, writes the starts read and " + ", ".join(walked)),
            _output_reading(program, walked, tokens, states, lam, token_bytes)]
    if staged:
        upper = list(staged.upper)
        increments = terms_of(upper, ("delta", "scan", "walk"))
        rows += [KernelCost("stage", 2 * sum(t.plan.flops for t in increments) / C,
                            (tokens(increments) + lam + states(staged.reads) + states(upper)) / C,
                            "every chunk's increments of the upper states from the lower starts"),
                 KernelCost("stage_scan", 0.0, (states(upper) + states(n for n in upper if n in read)) / C,
                            "sequential: reads the increments, writes the upper chunk-start states")]
        if derived_kernel and program.derived:
            carries = tuple(d.name for d in program.derived)
            rows += [KernelCost("derived", 2 * derived_macs(program) / C,
                                (states(program.derived_reads()) + _w_bytes(program, carries)) / C,
                                f"every chunk's {', '.join(carries)} from the stored starts"),
                     _output_reading(program, carries, tokens, states, lam, token_bytes)]
    return rows


def _recursions(program: ChunkProgram, walked) -> list:
    """The recursions of the derived carries ``walked`` (``ir.recursion``), each dropping a
    state the outputs read only through derived carries."""
    derived = program.derived_reads()
    elsewhere = {n for n, _ in program.states} - (derived - _carried(program.output + program.normalizer))
    return [recursion(program.algebra, d.name, d.poly, elsewhere) for d in program.derived if d.name in walked]


def _w_bytes(program: ChunkProgram, walked) -> int:
    """A chunk start of the derived carries ``walked`` (fp32)."""
    return sum(prod(n for i, n in poly_sizes(program, d.poly).items() if i in d.poly.free)
               for d in program.derived if d.name in walked) * FP32


def _output_reading(program: ChunkProgram, walked, tokens, states, lam: int, token_bytes: int) -> KernelCost:
    """The output kernel where a scan stored the derived carries ``walked`` at each chunk start:
    no derived carry formed; W's starts and the states it reads itself read."""
    C = program.chunk
    out_terms = program.output + program.normalizer
    return KernelCost("output", 2 * program.flops()["output"] / C,
                      (tokens(out_terms) + lam + states(_carried(out_terms)) + _w_bytes(program, walked)
                       + C * output_size(program) * token_bytes) / C,
                      "output terms; reads the derived carries' starts and the states it reads itself")


def _derived_walk(program: ChunkProgram, staged, walked, summaries: int, tokens, states, lam: int,
                  token_bytes: int) -> list[KernelCost]:
    """``scan_costs``' rows after the delta kernel where the second stage walks the derived
    carries ``walked``: the first stage's scan storing the starts the stage kernel or the output
    reads directly, the stage kernel (W's chunk terms from the tokens, the starts and the deltas
    of the states at the chunk's end), the walk of W, and the output kernel reading W."""
    C = program.chunk
    recs = _recursions(program, walked)
    terms = [t for r in recs for t in chunk_terms(program, r)]
    carried = [o for t in terms for o in t.operands if o.kind is Kind.CARRY]
    ends = {o.name for o in carried if o.anchor == "end"}
    direct = _carried(program.output + program.normalizer)
    w_bytes = _w_bytes(program, walked)
    stored = states(n for n in staged.lower if n in direct or n in {o.name for o in carried})
    names = ", ".join(r.name for r in recs)
    return [KernelCost("scan", 0.0, (summaries + stored) / C,
                       "sequential, elementwise: reads the deltas, writes the starts read"),
            KernelCost("stage", 2 * sum(t.plan.flops for t in terms) / C,
                       (tokens(terms) + lam + states({o.name for o in carried}) + states(ends) + w_bytes) / C,
                       f"every chunk's increment of {names} by its recursion"),
            KernelCost("stage_scan", 0.0, 2 * w_bytes / C,
                       f"sequential: reads the increments, writes {names} at each chunk start"),
            _output_reading(program, walked, tokens, states, lam, token_bytes)]
