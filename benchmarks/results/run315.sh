# Round 48, call 6: the generated row tiles without their spills (constexpr token strides in row-tiled kernels, the
# starts' offsets formed in the walk, the state terms planned at the tile so the decay multiplies the power tile:
# REG 225 / 234, STACK 0 at d = 128, C = 128 by the sm_90 compile probe; REG 255 / STACK 592 before) against the
# one-hot dots (the rule), power p = 2 gated at d = 128 on the chunk form (ATTENTION_FORM=never), each mode its own
# process (HLADSL_POWER_COLUMNS is read at import): forward at 16k and 64k, fwd + bwd at 16k; kernel profiles at 16k.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
for mode in auto rows; do
  HLADSL_POWER_COLUMNS=$mode timeout 150 python3 -m hladsl bench --specs power:p=2 --gated --baselines --modes fwd --d 128 \
    --T 16384 65536 --launch ATTENTION_FORM=never --json $OUT/run315_fwd_$mode.json --plot '' 2>&1 | grep "hladsl\|Error" | tail -4
  echo "[$mode fwd done at $SECONDS s]"
  HLADSL_POWER_COLUMNS=$mode timeout 120 python3 benchmarks/profile_kernels.py power:p=2 --gated --d 128 --T 16384 --mode fwd \
    --launch ATTENTION_FORM=never 2>&1 | grep -v Warning | tail -8
  echo "[$mode profile done at $SECONDS s]"
done
for mode in auto rows; do
  HLADSL_POWER_COLUMNS=$mode timeout 150 python3 -m hladsl bench --specs power:p=2 --gated --baselines --modes fwd+bwd --d 128 \
    --T 16384 --launch ATTENTION_FORM=never --json $OUT/run315_train_$mode.json --plot '' 2>&1 | grep "hladsl\|Error" | tail -3
  echo "[$mode fwd+bwd done at $SECONDS s]"
done
