"""Codegen: chunk programs to source text. It owns the Jinja templates
(``templates/*.jinja``, rendered with StrictUndefined), the lowering of plan
steps to Triton tile code (``steps``), the Triton and torch generators
(``triton_gen``, ``torch_gen``) and the on-disk cache of generated modules
keyed by a hash of their inputs (``cache``). It launches nothing: running
kernels is the runtime's job."""
