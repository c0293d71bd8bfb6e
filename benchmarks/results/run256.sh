# Round 38, third call: run 255's illegal memory access located (run256_repro.py, CUDA_LAUNCH_BLOCKING=1):
# hla3 bf16 stateless at the trial script's shape on this tree and on round 37's (.whl/old), and at
# neighbouring shapes; each case its own process (a fault poisons the context).
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl CUDA_LAUNCH_BLOCKING=1
NEW=$PYTHONPATH; OLD=/tmp/site:$PWD/.whl/old:$PWD/tests/gpu
R() { timeout 280 python3 benchmarks/results/run256_repro.py "$@" 2>&1 | grep -v Warning | tail -16; }
(R 2 2048 4 > /tmp/n1.log; R 2 2048 16 > /tmp/n2.log; R 1 4096 4 > /tmp/n3.log) &
(PYTHONPATH=$OLD R 2 2048 4 > /tmp/o1.log; PYTHONPATH=$OLD R 2 2048 16 > /tmp/o2.log) &
(R 2 2048 4 gated > /tmp/n4.log; R 1 1024 2 > /tmp/n5.log) &
wait
for f in /tmp/n1 /tmp/n2 /tmp/n3 /tmp/n4 /tmp/n5 /tmp/o1 /tmp/o2; do echo "== $f"; cat $f.log; done
