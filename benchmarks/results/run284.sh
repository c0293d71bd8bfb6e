# Round 44, runs 284 and 285: the hand-written row-tile prototype of power p = 2's forward (run284_rowtiles.py)
# beside hladsl's generated forward (run 284), then its two kernels apart at 1-3 pipeline stages (run 285).
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
python3 benchmarks/results/run284_rowtiles.py 128 64   # run 284
python3 benchmarks/results/run284_rowtiles.py stages   # run 285
