# Round 40 (prepared in round 39): Nsight Compute on hla3's gradient kernels (issue 10).
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
NCU=/usr/local/cuda/bin/ncu
timeout 560 $NCU --profile-from-start off --kernel-name regex:grad_kernel --launch-count 4 \
  --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
  --section SchedulerStats --section InstructionStats --section SourceCounters \
  python3 benchmarks/results/run266_profile.py > $OUT/ncu.txt 2>&1
echo "rc $?"; grep -E "ERR_|grad_kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Local|Achieved Occupancy|Stall|Executed Ipc|Shared Memory Configuration Size|Bank" $OUT/ncu.txt | head -80
