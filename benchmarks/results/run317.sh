# Round 48, call 8: issue 13's two host-side bars re-measured on this tree (last measured in round 16 on the H100):
# a cold process with a warm cache reaches its first hla2 call in <= 5 s; a B = 1, T = 64, H = 1 call <= 1.2x fla's.
set -u
timeout 200 python3 benchmarks/cold_start.py --spec hla2 --out $OUT/run317_cold.json 2>&1 | grep -v Warning | tail -12
echo "[cold start done at $SECONDS s]"
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
timeout 150 python3 benchmarks/host_cuda.py --n 300 2>&1 | grep -v Warning | tail -16
echo "[host done at $SECONDS s]"
