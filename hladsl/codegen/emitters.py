"""``hladsl compile --emit triton`` and the default ``compile`` (write the module)."""
from __future__ import annotations

from pathlib import Path

from hladsl.emit import DEFAULT_SIZES, register


def _program(spec, params, gated=True):
    from hladsl.ir.chunk import chunk_program
    from hladsl.ir.lower import lower_spec
    alg = lower_spec(spec, **params)
    sizes = tuple(sorted((d, DEFAULT_SIZES.get(d, 64)) for d in alg.dims))
    return alg, chunk_program(alg, 64, sizes, gated)


def _triton_source(spec, params, out_dir):
    from hladsl.codegen.triton_gen import generate
    alg, program = _program(spec, params)
    source = generate(program)
    if out_dir is None:
        return source
    path = Path(out_dir) / f"{alg.name}_triton.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return f"wrote {path} (Triton kernels for {alg.name}: state pass + output, d = dv = 64, C = 64, gated)\n"


def _torch_source(spec, params, out_dir):
    from hladsl.codegen.torch_gen import generate
    alg, program = _program(spec, params)
    source = generate(program)
    if out_dir is None:
        return source
    path = Path(out_dir) / f"{alg.name}_torch.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return f"wrote {path} (torch chunk program for {alg.name}, d = dv = 64, C = 64, gated)\n"


def _default(spec, params, out_dir):
    return _triton_source(spec, params, out_dir or ".")


register("triton", _triton_source)
register("torch", _torch_source)
register("default", _default)
