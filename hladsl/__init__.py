"""hladsl: a compiler from state-algebra specs of causal sequence mixers
(higher-order linear attention and friends) to fused Triton kernels and torch ops.

    import hladsl
    op = hladsl.load("hla2", normalize=True)
    o, final_state = op(q, k, v, g=None, output_final_state=True)

Layers import one way: frontend -> ir -> codegen -> runtime -> this public
surface (api, cli, emit, nn, bench).
"""
import warnings

# torch warns at import when the optional NumPy is absent; hladsl never needs it.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from hladsl.errors import AlgebraError, SpecCheckError, SpecError, SpecErrors, SpecSyntaxError  # noqa: E402 (after the warning filter)
from hladsl.version import __version__  # noqa: E402

__all__ = ["load", "compile_spec", "SpecError", "SpecSyntaxError", "SpecCheckError",
           "SpecErrors", "AlgebraError", "__version__"]


def compile_spec(name_or_path, **params):
    """Parse, check and lower a spec to its state algebra (hladsl.ir.algebra.Algebra)."""
    from hladsl.api import algebra
    return algebra(name_or_path, **params)


def load(name_or_path, *, backend: str = "auto", chunk_size: int | None = None, **params):
    """The torch op of a shipped spec name or a path to a .hla file,
    memoised per spec text, parameters, backend and chunk size (None: the launch
    rules choose per call, ``runtime.launch.chunk_for``)."""
    from hladsl.api import load as load_op
    return load_op(name_or_path, backend=backend, chunk_size=chunk_size, **params)


def __getattr__(name):
    """``hladsl.nn`` without importing it (and torch.nn's modules) at ``import hladsl``."""
    if name == "nn":
        import importlib
        return importlib.import_module("hladsl.nn")
    raise AttributeError(f"module 'hladsl' has no attribute {name!r}")
