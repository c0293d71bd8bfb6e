#!/usr/bin/env bash
# The GPU test suite (tests/gpu) in one command, with reports.
#
#   benchmarks/gpu_tests.sh [--quick] [-n WORKERS] [PYTEST ARGS...]
#
#   --quick      deselect the `slow` cases (T = 65536, d = 128, the largest compiles)
#   -n WORKERS   pytest-xdist workers (default 8; compiles are CPU-bound, one GPU is shared)
#   -m MARKERS   the selection (default "gpu"; --quick: "gpu and not slow")
#   PYTEST ARGS  passed on, e.g. -k hla2
#   GPU_TESTS_BUDGET=SECONDS (default 540): pytest is interrupted (SIGINT) after this
#                long, so that a run overrunning the device's 10-minute command limit
#                still writes its reports for the tests that finished
#
# Writes to $OUT (default ./gpu-test-results): gpu-junit.xml, gpu-summary.json
# (passed / failed / skipped, device, versions, failures), gpu-ratios.json (every
# RMS ratio the tests recorded) and gpu-pytest.log; prints one summary line.
# Exit status: pytest's. Wheels in .whl/ (lark, ... as in benchmarks/RESULTS.md) are
# installed to /tmp/site first. Tests sharing generated kernels carry one
# xdist_group, so `--dist loadgroup` compiles each kernel set on one worker.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-test-results}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"

workers=8
marker="gpu"
passthrough=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) marker="gpu and not slow" ;;
    -n) workers="$2"; shift ;;
    -m) marker="$2"; shift ;;   # e.g. -m "gpu and slow" (named in the summary line)
    *) passthrough+=("$1") ;;
  esac
  shift
done

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# one kernel cache for all workers (written atomically by Triton and by hladsl)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/hladsl-gpu-tests/triton}
export HLADSL_CACHE_DIR=${HLADSL_CACHE_DIR:-/tmp/hladsl-gpu-tests/hladsl}

# -v: xdist prints each outcome as it lands ("[gw3] [ 10%] PASSED tests/gpu/..."), which the
# summary counts when no JUnit XML was written (a worker that hangs at shutdown after every
# test has finished keeps pytest from writing it until the budget interrupts it)
args=(tests/gpu -m "$marker" --junitxml="$OUT/gpu-junit.xml" -o junit_family=xunit1
      -p no:cacheprovider -rfE --durations=30 -v)
if "$PYTHON" -c "import xdist" 2>/dev/null; then
  if [ "$workers" -gt 0 ]; then args+=(-n "$workers" --dist loadgroup); else args+=(-n 0); fi
else
  echo "gpu_tests.sh: pytest-xdist is not installed: running on one worker" >&2
  workers=0
  args+=(-o addopts=)   # pyproject's "-n auto" needs xdist
fi
if "$PYTHON" -c "import pytest_timeout" 2>/dev/null; then
  args+=(--timeout=480)   # one hung kernel must not eat the whole run
fi
budget=${GPU_TESTS_BUDGET:-540}

start=$(date +%s)
timeout --signal=INT --kill-after=30 "$budget" \
  "$PYTHON" -m pytest "${args[@]}" "${passthrough[@]}" 2>&1 | tee "$OUT/gpu-pytest.log"
rc=${PIPESTATUS[0]}   # 124: interrupted at the budget
elapsed=$(( $(date +%s) - start ))

"$PYTHON" - "$OUT" "$rc" "$elapsed" "$marker" "$workers" <<'EOF'
"""Summarise the JUnit XML: counts, failures, device, versions; the RMS ratios apart."""
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, rc, elapsed, marker, workers = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), \
    sys.argv[4], sys.argv[5]
counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
failures, skipped, ratios = [], {}, {}
try:
    root = ET.parse(out / "gpu-junit.xml").getroot()
    cases = list(root.iter("testcase"))
except (OSError, ET.ParseError) as exc:
    cases = []
    failures.append(f"no JUnit XML: {exc}")
if not cases:   # no JUnit XML: the outcomes xdist printed as they landed (-v)
    import re
    kind = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
            "XFAIL": "skipped", "XPASS": "passed"}
    log = (out / "gpu-pytest.log").read_text(errors="replace") if (out / "gpu-pytest.log").exists() else ""
    for outcome, name in re.findall(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)",
                                    log, re.M):
        counts[kind[outcome]] += 1
        if outcome in ("FAILED", "ERROR"):
            failures.append(name + (" (error)" if outcome == "ERROR" else ""))
    if any(counts.values()):
        failures = ["no JUnit XML (or none of its cases): outcomes counted from the -v log"] + [
            f for f in failures if not f.startswith("no JUnit XML")]
for case in cases:
    if case.get("name") is None:   # the test running when the budget interrupted pytest
        continue
    name = f"{case.get('classname', '')}::{case.get('name')}"
    kinds = {child.tag for child in case}
    if "failure" in kinds:
        counts["failed"] += 1
        failures.append(name)
    elif "error" in kinds:
        counts["errors"] += 1
        failures.append(name + " (error)")
    elif "skipped" in kinds:
        counts["skipped"] += 1
        reason = case.find("skipped").get("message", "")
        skipped[reason] = skipped.get(reason, 0) + 1
    else:
        counts["passed"] += 1
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    if props:
        ratios[name] = props

try:
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    torch_version = torch.__version__
except Exception as exc:   # the summary must still be written
    device, torch_version = f"unknown ({exc})", "unknown"
try:
    import triton
    triton_version = triton.__version__
except Exception:
    triton_version = "absent"

summary = dict(counts, exit_status=rc, interrupted_at_budget=rc == 124, seconds=elapsed,
               selection=marker, workers=workers,
               device=device, torch=torch_version, triton=triton_version,
               failures=failures, skip_reasons=skipped)
(out / "gpu-summary.json").write_text(json.dumps(summary, indent=1) + "\n")
(out / "gpu-ratios.json").write_text(json.dumps(ratios, indent=1) + "\n")
print(f"gpu tests: {counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
      f"{counts['skipped']} skipped in {elapsed} s{' (INTERRUPTED at the budget)' if rc == 124 else ''} "
      f"on {device} (torch {torch_version}, "
      f"triton {triton_version}; -m '{marker}', {workers} workers) -> {out}/gpu-summary.json")
EOF
exit "$rc"
