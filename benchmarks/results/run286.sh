# Round 44, run 286: the generated power p = 2 forward at d = 128 (gated, T = 16k), its kernels apart, at the
# walking state pass's default 4 pipeline stages and at 2 and 3.
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
for st in "" "WALKER_STAGES=2" "WALKER_STAGES=3"; do
  python3 benchmarks/profile_kernels.py power:p=2 --gated --mode fwd --d 128 --T 16384 ${st:+--launch $st}
done
