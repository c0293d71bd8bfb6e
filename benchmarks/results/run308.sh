# Round 47, call 9: where the windowed prototype's time goes (benchmarks/proto_window.py parts): the windows'
# attention, its state pass and its output kernel apart, d = 128 and 64, T = 65536, W = 1024; then row-tiled
# kernels (one column times an aligned slice: no gathers), tiles 32 / 64 wide, 4 / 8 warps; the state pass on
# values decayed once (not per tile), 64 or 128 rows a step.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
timeout 200 python3 benchmarks/proto_window.py parts 2>&1 | grep -v "compiling " | tail -8
