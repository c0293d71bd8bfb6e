# Round 38, fourth call: does run 255's illegal memory access recur? run254_trials.py three times alone
# (no CUDA_LAUNCH_BLOCKING), and compute-sanitizer's memcheck on the same call at a small shape where the
# tool exists on the device.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
S=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
echo "compute-sanitizer: ${S:-none}"
if [ -n "$S" ]; then
  (timeout 300 $S --tool memcheck --print-limit 5 python3 benchmarks/results/run256_repro.py 1 1024 2 > /tmp/san.log 2>&1; echo "rc $?" >> /tmp/san.log) &
fi
for i in 1 2 3; do
  timeout 150 python3 benchmarks/results/run254_trials.py 2>&1 | grep -v -i warn | tail -9
  echo "trial run $i rc ${PIPESTATUS[0]} at $SECONDS s"
done
wait
[ -n "$S" ] && grep -v -i "warn" /tmp/san.log | tail -40
