# Round 47, call 6: the windowed hybrid prototype (benchmarks/proto_window.py, hand-written, not the op's):
# power p = 2 gated forward at d = 128 / 64, T = 65536, B = 2, H = 16, beside the op by the rule and on the
# attention form; first checked against the op at T = 4096.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
timeout 380 python3 benchmarks/proto_window.py 2>&1 | grep -v "compiling " | tail -20
