# Next session (prepared in round 39, not run yet): Nsight Compute on hla3's gradient kernels (issue 10).
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
NCU=/usr/local/cuda/bin/ncu
timeout 560 $NCU --profile-from-start off --kernel-name regex:grad_kernel --launch-count 4 \
  --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
  python3 benchmarks/results/run266_profile.py > $OUT/ncu.txt 2>&1
echo "rc $?"; grep -E "ERR_|grad_kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Local|Achieved Occupancy|Stall|Executed Ipc|Shared Memory Configuration Size|Bank" $OUT/ncu.txt | head -80
