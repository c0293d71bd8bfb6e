"""Runtime: running compiled specs on tensors. It owns the torch op (``op``:
input binding and validation (``validate``), the differentiable preparation of
chunk tiles, the torch and Triton cores), its one autograd path as a torch
custom op (``custom_op``), the launch layer that picks every kernel launch
configuration and fallback (``launch``), the Triton forward and backward
runners (``triton_forward``, ``triton_backward``), the torch chunk execution
(``chunk_torch``) and the torch executor of the backward program
(``backward_torch``, the kernels' reference), decode (``step``), context
parallelism over torch.distributed (``context_parallel``), packed state storage
(``packing``) and the naive masked reference (``naive``)."""
