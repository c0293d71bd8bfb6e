# Round 47, call 5: issue 10's power bar at 64k on the H200 (fwd + bwd faster than retention's power_retention,
# gated, d = 64; last timed in run 171 on the H100: 0.77x). retention's backward autotunes for minutes without
# TRITON_NO_AUTOTUNE=1 (set); its cold compile may take minutes.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
timeout 380 python3 -m hladsl bench --specs power:p=2 --gated --baselines retention --modes fwd+bwd --d 64 --T 65536 \
  --plot '' --json $OUT/run304_retention.json 2>&1 | grep -v "^wrote\|compiling " | tail -12
