# Round 44, run 288: row tiles (then "auto" at d = 128, since made opt-in: set HLADSL_POWER_COLUMNS=rows to repeat)
# at 1-3 walking pipeline stages, same process.
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
HLADSL_POWER_COLUMNS=rows python3 -m hladsl bench --specs power:p=2 --gated --baselines --modes fwd --d 128 --T 16384 \
  --launch WALKER_STAGES=2 --launch WALKER_STAGES=1 --launch WALKER_STAGES=3 --json $OUT/run288.json --plot ''
