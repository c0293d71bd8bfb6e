# Round 37, third call: hla3's and hla3_masked's GPU cases (all marked slow, so the quick suite of runs 247 and
# 250 held none) on this tree: the run-length rule's parted groups (ungated carried hla3 now in runs of 8),
# round 36's unit fix (gated carried hla3), as written with a state, varlen, torch.compile.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
mkdir -p $OUT/t
K="(hla3 and two_pass and d64 and (bf16-ungated-plain-two_pass-nostate or bf16-gated-plain-two_pass-nostate or bf16-gated-plain-two_pass-state or fp16-ungated-plain)) or varlen_matches_each_sequence_alone or (compiled_forward_backward and hla3)"
OUT=$OUT/t GPU_TESTS_BUDGET=560 bash benchmarks/gpu_tests.sh -m "gpu" -n 10 -k "$K" 2>&1 | tail -2
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/t/gpu-summary.json"))
for f in d.get("failures", [])[:5]:
    print(str(f)[:600])
PY
