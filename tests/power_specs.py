"""Power specs that differ from the shipped one in their dims, for the tests of how kernels
form packed columns (tests/test_triton_backward.py, tests/test_attention_form.py)."""

# a power whose base dim is also the output's value dim (v[d]): kernels split over that dim
SHARED_DIM_POWER = """mechanism powshared {
  dims d
  input q[d], k[d], v[d]
  param p = 2, normalize = false, eps = 1e-6
  state U[i^p, e] = k[i^p] v[e]  symmetric(i^p)
  state z[i^p] = k[i^p]  symmetric(i^p)
  output o[e] = q[i^p] U[i^p, e]
  normalizer = q[i^p] z[i^p]
}
"""

# the same with a value dim named after the packed dim (d_pow2x beside the packed d_pow2)
PREFIXED_DIM_POWER = (SHARED_DIM_POWER.replace("mechanism powshared", "mechanism prefixed")
                      .replace("dims d\n", "dims d, d_pow2x\n").replace("v[d]", "v[d_pow2x]"))
