# Round 48, call 2: the launch rule counting the chunk form's one-hot column dots -- power at d = 128 by the
# rule / the attention form / the chunk form (forward at 64k and 96k, normalised at 64k; fwd + bwd at 64k);
# (run 311's first attempt lost the forms' lines to a tail cut; run 312 is the forms alone)
# issue 10's hla3 ratio beside the references' own fwd + bwd / fwd (fla chunk_simple_gla, SDPA) at 16k.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
timeout 300 python3 benchmarks/results/run311_forms.py 2>&1 | grep -v Warning | tail -40
echo "[forms done at $SECONDS s]"
timeout 240 python3 -m hladsl bench --specs hla3 hla3_masked --baselines fla sdpa --modes fwd fwd+bwd --d 64 --T 16384 \
  --json $OUT/run311_ratios.json --plot '' 2>&1 | grep -v "^wrote\|compiling " | tail -20
echo "[bench done at $SECONDS s]"
