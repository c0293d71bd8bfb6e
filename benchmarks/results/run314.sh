# Round 48, call 5: issue 13's d = 128 / d = 64 ratio for power at 64k in one process -- the op by its rule at both
# widths beside the windowed prototype (paired state pass, sliced output) at W = 1024 and 2048 (proto_window.py against).
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
timeout 300 python3 benchmarks/proto_window.py against 2>&1 | grep -v Warning | tail -8
echo "[against done at $SECONDS s]"
