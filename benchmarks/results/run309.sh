# Round 47, call 10: the windowed prototype's row-tiled parts at larger steps (benchmarks/proto_window.py best):
# d = 128, T = 65536, W = 1024, the state pass at 128 / 256 rows a step, the output at 64 / 128 query rows.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
timeout 150 python3 benchmarks/proto_window.py best 2>&1 | grep -v "compiling " | tail -8
