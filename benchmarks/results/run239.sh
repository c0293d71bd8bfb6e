# Round 34, run 239: which launch rule lets the carried form's d = 128 backward run, and what each costs.
set -u
V0="CARRY_DERIVED=true"
V1="CARRY_DERIVED=true GRAD_WARPS=8"
V2="CARRY_DERIVED=true GRAD_WHOLE_MAX_MATMULS=0 GRAD_NETWORKS_PER_PROGRAM=2"
V3="CARRY_DERIVED=true GRAD_WHOLE_MAX_MATMULS=0 GRAD_NETWORKS_PER_PROGRAM=1"
passing=()
for v in "$V1" "$V2" "$V3"; do
  ok=1
  for d in 128 64; do
    [ $ok = 0 ] && break
    for gated in 0 1; do
      out=$(HLADSL_LAUNCH="$v" timeout 300 python3 benchmarks/results/run239_probe.py $gated $d 4096 2>&1 | tail -1)
      echo "$out"
      case "$out" in OK*) ;; *) ok=0 ;; esac
    done
  done
  [ $ok = 1 ] && passing+=("$v")
done
echo "PASSING: ${passing[*]/#/|}"
args=()
for v in "${passing[@]}"; do args+=(--launch $v); done
python3 -m hladsl bench --specs hla2 --baselines fla --modes fwd+bwd --T 16384 --d 64 128 "${args[@]}" --json $OUT/run239_bench.json --plot '' 2>&1 | grep -v "^\s*$" | tail -30
