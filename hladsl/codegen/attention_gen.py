"""Triton source of a chunk program's attention form (``ir.attention``): one kernel,
grid (query chunk, sequence·head), each program summing the pairwise terms over the key
chunks at or before its own, newest first -- the forward of a stateless call with no
chunk-start state at all.

The terms are lowered as the output kernel's in-chunk terms are (``triton_gen._Lowering``),
with two changes: a token tile on the key side is loaded from the key chunk (``ink_<x>``,
``rawk_<x>``, ``basek_<x>``), and the mask M[t, n] = [n rel t] exp(W (Λ_t − Λ_n)) is
formed from the two chunks' in-chunk gates and the gap between their starts,
lam_gap = Σ of the totals of the chunks from the key's up to the query's (the kernel sums
it as it walks back), so no Λ over the whole sequence is ever formed: its fp32 rounding at
large |Λ| would reach every decay. The module holds the forward module's kernels too (the
template includes theirs for its macros); only ``attention_kernel`` is launched from it.
"""
from __future__ import annotations

import re

from hladsl.codegen import templates
from hladsl.codegen.prune import prune_dead
from hladsl.codegen.steps import Tile, comment
from hladsl.codegen.templates import render_template
from hladsl.codegen.triton_bwd import _BwdLowering, _grad_code
from hladsl.codegen.triton_gen import _defs, _Lowering, kernel_context
from hladsl.ir.attention import attention_backward, attention_form, pairwise_network, time_indices, why_not
from hladsl.ir.backward import BackwardProgram, backward_program
from hladsl.ir.chunk import ChunkProgram
from hladsl.version import __version__

TEMPLATE = "attention_kernels.py.jinja"
BWD_TEMPLATE = "attention_bwd_kernels.py.jinja"   # the forward's kernel too, storing den for it


class _KeyChunkTiles:
    """Lowering hooks of the attention form (a mixin before ``_Lowering`` or ``_BwdLowering``):
    token tiles of the query's time index ``query`` from the query chunk i_c (``in_<x>``),
    the others from the key chunk i_k (``ink_<x>``, ``rawk_<x>``, ``basek_<x>``), and masks
    across the two chunks."""

    def key_side(self, query: str) -> None:
        self.query = query                  # the output's time index: the query chunk's tokens
        self.query_inputs: dict[str, dict] = {}
        self.key_inputs: dict[str, dict] = {}

    def _token_tile(self, o, defs):
        x = o.name
        if o.indices[0] == self.query:
            self.query_inputs.setdefault(x, self.input_info(x))
            return super()._token_tile(o, defs)
        self.key_inputs.setdefault(x, {**self.input_info(x), "scaled": self.scaled_load(x, f"rawk_{x}")
                                       if x in self.scaled else ""})
        return self.token_tile(o, f"ink_{x}", f"rawk_{x}", f"basek_{x}")   # (loaded in the key loop)

    @staticmethod
    def mask_keep(rel: str, query: str, key: str) -> str:   # off the diagonal every pair is causal
        return f"(({_Lowering.mask_keep(rel, query, key)}) | (i_k < i_c))"

    @staticmethod
    def mask_gap(query: str, key: str) -> str:   # the query chunk's start minus the key chunk's: lam_gap
        return f"lam{query} + lam_gap - lamk{key}"


class _AttentionLowering(_KeyChunkTiles, _Lowering):
    """The in-chunk lowering with the key side's tokens and gates taken from the key chunk."""

    def __init__(self, program: ChunkProgram, query: str):
        super().__init__(program)
        self.key_side(query)


class _AttentionBwdLowering(_KeyChunkTiles, _BwdLowering):
    """The gradient networks' lowering, tiles as ``_AttentionLowering``'s; d num's transposed
    tile is its register tile transposed (the query-side kernel computes it: a normalised
    program's d num is never read back there)."""

    merges_last_products = True   # (a normalised program's den networks end in num's last products)

    def __init__(self, bwd: BackwardProgram, query: str):
        super().__init__(bwd)
        self.key_side(query)

    def _cotangent_tile(self, o, defs):
        tile = Tile(f"ct_{o.name}", o.indices)
        if o.name == "num":
            self.block.raw[tile.var] = "rawct_num"
            self.block.transposed[tile.var] = "tl.trans(rawct_num)"
        return tile


def attention_context(program: ChunkProgram) -> dict:
    """The forward's template context plus ``attention``: the kernel's inputs (query and key
    side), its mask definitions, and the code of the output's and normaliser's terms: those
    of the query chunk alone (``self_num``, ``self_den``) and the pairwise ones over one
    (query chunk, key chunk) pair (``pair_num``, ``pair_den``)."""
    form = attention_form(program)
    if form is None:
        raise ValueError(f"{program.algebra.name} has no attention form: {why_not(program)}")
    queries = {time_indices(t)[0] for t in form.output + form.normalizer}
    if len(queries) != 1:
        raise ValueError(f"{program.algebra.name}: the attention form's terms index the query "
                         f"by {sorted(queries)}, not one token")
    low = _AttentionLowering(program, queries.pop())
    defs: dict = {}
    code = {}
    # terms of token t alone (no key: a strict mask's diagonal, a skip term) once, before the
    # key loop; the pairwise ones once a key chunk, in it. Every term before the loop is lowered
    # first: CSE hands a later term only temps computed above it, so no code before the loop
    # reads one the loop defines
    for where, keyed in (("self", False), ("pair", True)):
        for part, terms in (("num", form.output), ("den", form.normalizer)):
            chosen = tuple(t for t in terms if (time_indices(t)[1] is not None) == keyed)
            code[f"{where}_{part}"] = (low.terms(chosen, f"{where}_{part}", defs, precision_of=part)["pre"]
                                       if chosen else "")
    context = kernel_context(program)
    context["attention"] = {
        "query": low.query,
        "query_inputs": list(low.query_inputs.values()),
        "key_inputs": list(low.key_inputs.values()),
        "inputs": list({**low.query_inputs, **low.key_inputs}.values()),
        "dims": list(low.dims), "defs": _defs(defs), **code,
        "chained_dots": low.block.chained,   # (launch.dot_override)
        "terms": [comment(t.source) for t in form.output + form.normalizer],
    }
    return context


def attention_bwd_context(program: ChunkProgram) -> dict:
    """``attention_context`` plus ``attention_bwd``: the backward's two kernels, each summing
    its networks (``ir.attention.attention_backward``) over chunk pairs -- ``query`` (dq, dΛ_t:
    a query chunk over its key chunks, newest first, as the forward) and ``key`` (dk, dv, dΛ_n:
    a key chunk over the query chunks from its own to its sequence's last). Per kernel: its
    inputs by side, mask definitions, accumulators, and the code of the networks of token t
    alone (``self``, once, before the loop) and of the pairwise ones (``pair``, in it)."""
    context = attention_context(program)
    ab = attention_backward(program)
    bwd = backward_program(program)
    query = context["attention"]["query"]
    kernels = {}
    for side, grads in (("query", ab.query), ("key", ab.key)):
        low = _AttentionBwdLowering(bwd, query)
        defs: dict = {}
        code, accs, inits = {}, [], []
        for where, keyed in (("self", False), ("pair", True)):   # (self first: see attention_context)
            chosen = [g for g in grads if pairwise_network(g) == keyed]
            if side == "key" and chosen and not keyed:
                raise ValueError(f"{chosen[0].text()}: a key-side network without an earlier token")
            mark = len(low.block.lines)
            got, zeroing = _grad_code(low, chosen, defs, frozenset())
            code[where] = "\n".join(low.block.lines[mark:]).strip("\n")
            for acc, line in zip(got, zeroing):
                if acc not in accs:
                    accs.append(acc)
                    inits.append(line)
        loop_only = [v for v in defs if re.search(rf"\b{v}\b", code["self"])]
        if loop_only:   # (the definitions are made in the key loop: they read both chunks)
            raise ValueError(f"{program.algebra.name}: a network of token t alone reads {loop_only}")
        kernels[side] = {"query_inputs": list(low.query_inputs.values()),
                         "key_inputs": list(low.key_inputs.values()),
                         "defs": _defs(defs), "inits": "\n".join(inits), "self": code["self"],
                         "pair": code["pair"], "targets": [a[3:] for a in accs if a.startswith("dx_")],
                         "dlam": "dlam" in accs, "chained_dots": low.block.chained,
                         "networks": [comment(g.text()) for g in grads]}
    base = _Lowering(program)   # (every input: either kernel may read or write any)
    names = list(base.input_dim.items())
    context["attention_bwd"] = {
        **kernels,
        "inputs": [base.input_info(x) for x, _ in names],
        "grads": [{"name": x, "dim": dim, "query": x in kernels["query"]["targets"],
                   "key": x in kernels["key"]["targets"]} for x, dim in names],
        "chained_dots": kernels["query"]["chained_dots"] or kernels["key"]["chained_dots"],
    }
    return context


def template_text() -> str:
    return templates.template_text(TEMPLATE, "chunk_kernels.py.jinja")


def bwd_template_text() -> str:
    return templates.template_text(BWD_TEMPLATE, TEMPLATE, "chunk_kernels.py.jinja")


def render(context: dict, version: str, template: str = TEMPLATE) -> str:
    return prune_dead(render_template(template, version=version, **context))


def attention_source(program: ChunkProgram) -> str:
    """The module of ``program``'s attention form (uncached)."""
    return render(attention_context(program), __version__)


_MODULES: dict[int, tuple] = {}   # id(program) -> (program, module, context)


def attention_kernels(program: ChunkProgram):
    """(module, context): the imported module with ``attention_kernel`` for ``program``,
    rendered once, then served from the disk cache (``codegen.cache``)."""
    hit = _MODULES.get(id(program))
    if hit is None or hit[0] is not program:
        from hladsl.codegen.cache import cache_key, load_module
        context = attention_context(program)
        key = cache_key(context, template_text())
        module = load_module(context["name"] + "_attention", key, lambda: render(context, __version__))
        hit = _MODULES[id(program)] = (program, module, context)
    return hit[1], hit[2]


def attention_bwd_source(program: ChunkProgram) -> str:
    """The module of ``program``'s attention form with its backward (uncached)."""
    return render(attention_bwd_context(program), __version__, BWD_TEMPLATE)


_BWD_MODULES: dict[int, tuple] = {}


def attention_bwd_kernels(program: ChunkProgram):
    """(module, context): ``attention_kernel`` and the backward's ``attention_query_grad_kernel``
    and ``attention_key_grad_kernel`` for ``program``, rendered once, then disk-cached."""
    hit = _BWD_MODULES.get(id(program))
    if hit is None or hit[0] is not program:
        from hladsl.codegen.cache import cache_key, load_module
        context = attention_bwd_context(program)
        key = cache_key(context, bwd_template_text())
        module = load_module(context["name"] + "_attention_bwd", key,
                             lambda: render(context, __version__, BWD_TEMPLATE))
        hit = _BWD_MODULES[id(program)] = (program, module, context)
    return hit[1], hit[2]
