# Round 42, run 273 (on d5315d7 with an experimental switch: see run273_states.py): the backward's starts and d-states in bf16, hla3 ungated, same process.
# (Its first attempt ran 530 s and printed nothing: an fp32 Triton reference's compiles; now the torch path's.)
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
cd benchmarks/results
timeout 400 python3 run273_states.py hla3 2>&1 | grep --line-buffered -v compiling | tee $OUT/run273.txt
echo "done at $SECONDS s"
