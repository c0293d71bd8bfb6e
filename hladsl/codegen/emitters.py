"""``hladsl compile --emit triton|torch`` and the default ``compile`` (write the
Triton module and say where)."""
from __future__ import annotations

from pathlib import Path

from hladsl.emit import DEFAULT_SIZES, register


def _program(spec, params, gated=True):
    from hladsl.ir.chunk import chunk_program
    from hladsl.ir.lower import lower_spec
    alg = lower_spec(spec, **params)
    sizes = tuple(sorted((d, DEFAULT_SIZES.get(d, 64)) for d in alg.dims))
    return alg, chunk_program(alg, 64, sizes, gated)


def _source(backend: str, what: str):
    def emit(spec, params, out_dir):
        if backend == "triton":
            from hladsl.codegen.triton_gen import generate
        else:
            from hladsl.codegen.torch_gen import generate
        alg, program = _program(spec, params)
        source = generate(program)
        if out_dir is None:
            return source
        path = Path(out_dir) / f"{alg.name}_{backend}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        return f"wrote {path} ({what} for {alg.name}: d = dv = 64, C = 64, gated)\n"
    return emit


_triton = _source("triton", "Triton kernels, state pass + output")
register("triton", _triton)
register("torch", _source("torch", "torch chunk program"))
register("default", lambda spec, params, out_dir: _triton(spec, params, out_dir or "."))
