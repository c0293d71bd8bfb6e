# Round 47, call 7: where the windowed prototype's time goes (benchmarks/proto_window.py parts): the windows'
# attention, its state pass and its output kernel apart, d = 128 and 64, T = 65536, W = 1024.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
timeout 200 python3 benchmarks/proto_window.py parts 2>&1 | grep -v "compiling " | tail -8
