# Round 40: where hla3's gradient kernels' excess global sectors come from (run 266: 17-38 % of their L2
# sectors "excessive", uncoalesced) -- Nsight Compute's source page (per generated-source line) of the dq
# group's first part and of the dv group (launch-skip 4: dq in 4 runs, dk in 5, then dv whole).
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
NCU=/usr/local/cuda/bin/ncu
for skip in 0 9; do
  timeout 280 $NCU --profile-from-start off --kernel-name regex:grad_kernel --launch-skip $skip --launch-count 1 \
    --section SourceCounters --section MemoryWorkloadAnalysis_Tables --import-source yes --page source --csv --print-source cuda \
    python3 benchmarks/results/run266_profile.py > $OUT/src$skip.csv 2> $OUT/src$skip.err
  echo "skip $skip rc $? $(wc -l < $OUT/src$skip.csv) lines"; tail -3 $OUT/src$skip.err
done
ls /tmp/hl/hladsl/modules/ 2>/dev/null | head; cp /tmp/hl/hladsl/modules/hla3_carried_bwd_*.py $OUT/ 2>/dev/null
head -3 $OUT/src0.csv | cut -c1-600
