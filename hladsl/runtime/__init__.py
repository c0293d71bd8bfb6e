"""Runtime: running compiled specs on tensors. It owns the torch op
(``op``: input binding and validation, the differentiable preparation of chunk
tiles, the torch and Triton cores), its one autograd path as a torch custom op
(``custom_op``), the launch layer that picks every kernel launch configuration
and fallback (``launch``), the Triton forward runner (``triton_forward``), the
torch chunk execution (``chunk_torch``), packed state storage (``packing``),
the serial reference and the naive masked reference."""
