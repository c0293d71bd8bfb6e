"""hladsl: a compiler from state-algebra specs of causal sequence mixers
(higher-order linear attention and friends) to fused Triton kernels and torch ops.

    import hladsl
    op = hladsl.load("hla2", normalize=True)
    o, final_state = op(q, k, v, g=None, output_final_state=True)
"""
import warnings

# torch warns at import when the optional NumPy is absent; hladsl never needs it.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from hladsl.errors import AlgebraError, SpecCheckError, SpecError, SpecErrors, SpecSyntaxError

__version__ = "0.1.0"

__all__ = ["load", "compile_spec", "SpecError", "SpecSyntaxError", "SpecCheckError",
           "SpecErrors", "AlgebraError", "__version__"]


def compile_spec(name_or_path, **params):
    """Parse, check and lower a spec to its state algebra (hladsl.ir.Algebra)."""
    from hladsl.ir.lower import lower_spec
    return lower_spec(name_or_path, **params)


def load(name_or_path, **params):
    """A torch op for a shipped spec name or a path to a .hla file (DESIGN section 6)."""
    from hladsl.runtime.op import Op
    return Op(compile_spec(name_or_path, **params))
