# Round 40 (the GRAD_SERIAL_PARTS switch it times was declined and is not in the tree): (a) hla3's gradient kernels' parts one after another in each program (GRAD_SERIAL_PARTS, a runtime
# loop over the parts: one launch a target) against a launch a part, fwd + bwd, same process; the compile probe
# says the loop spills more (ptxas: dq in runs of 8 1784 B of stack against at most 824 a part). (b) Nsight
# Compute's SASS source page of the dv group's kernel: which instructions request the excess global sectors.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
NCU=/usr/local/cuda/bin/ncu
timeout 200 $NCU --profile-from-start off --kernel-name regex:grad_kernel --launch-skip 9 --launch-count 1 \
  --section SourceCounters --import-source yes --page source --csv --print-source sass \
  python3 benchmarks/results/run266_profile.py > $OUT/sass9.csv 2> $OUT/sass9.err
echo "ncu rc $? $(wc -l < $OUT/sass9.csv) lines"; sed -n 1,12p $OUT/sass9.csv | cut -c1-400
for gated in "" "--gated"; do
  timeout 330 python3 -m hladsl bench --specs hla3 hla3_masked $gated --baselines fla --modes fwd fwd+bwd --T 16384 \
    --launch GRAD_SERIAL_PARTS=true --launch GRAD_SERIAL_PARTS=true GRAD_LONG_RUN=0 \
    --json $OUT/run268${gated/--/_}.json --plot '' 2>&1 | grep -v "^\s*$" | grep -v "compiling" | tail -14
  echo "done at $SECONDS s"
done
