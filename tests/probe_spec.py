"""A spec written for the backward tests, unlike every shipped one."""

# No shipped spec has these: a packed symmetric state consumed next to a token at
# the query time (spow(q) v_t K2), a weight-0 state, a weight-2 state feeding a
# cross term, q·q inner products at one time, a normalizer with no carried sum.
PROBE = """
mechanism backward_probe {
  dims d, dv
  input q[d], k[d], v[dv]
  param normalize = false, eps = 1e-6
  state K2[i, j] = k[i] k[j]  symmetric(i, j)
  state V[j, e] = k[j] v[e]  decay 2
  state Z[e] = v[e]  decay 0
  state X[i, e] = 0  cross K2@B[i, j] V@A[j, e]  decay 3
  output o[e] = q[i] q[j] K2[i, j] v[e] + q[i] X[i, e] - q[i] V[i, e] + q[i] q[i] Z[e]
  normalizer = q[i] q[j] K2[i, j] + 2 q[i] q[i]
}
"""
