# Round 41: hla3's gradient kernels at 8 warps (GRAD_WARPS=8: half the registers a thread for the same tiles),
# with bf16x3 exact products (EXACT_DOTS=bf16x3: twice tf32x3's tensor-core rate; also the output kernel's), and
# at chunk 32 (BACKWARD_CHUNK=32: half the token tiles) against the tree, fwd + bwd, same process, ungated.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
timeout 540 python3 -m hladsl bench --specs hla3 --baselines fla --modes fwd fwd+bwd --T 16384 \
  --launch GRAD_WARPS=8 --launch EXACT_DOTS=bf16x3 --launch BACKWARD_CHUNK=32 \
  --json $OUT/run270.json --plot '' 2>&1 | grep -v "^\s*$" | grep -v "compiling" | tail -24
echo "done at $SECONDS s"
