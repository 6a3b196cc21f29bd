#!/usr/bin/env bash
# The one script a GPU machine runs for this project, and its dry run on the CPU:
#
#   bash launch/gpu_check.sh             # on a GPU machine: NCCL, CUDA, model=gpt2 (under 8 minutes on one GPU)
#   bash launch/gpu_check.sh --dry-run   # the same steps on gloo and the CPU, model=tiny (the test suite runs it)
#
# Results go under $GPU_CHECK_DIR (default ${OUT:-runs}/gpu_check). Each check prints one verdict line
# (PASS, FAIL or SKIP with its reason); the last line counts them; the exit status is non-zero if any failed.
#
#   1. versions: python, torch, CUDA, NCCL, the GPUs (machine.txt);
#   2. the GPU-marked tests (pytest -m gpu), which skip with their reason where they cannot run;
#   3. one rank, one process group on the backend: every communication call and every strategy's steps on
#      the device, against the single run (launch/gpu_selfcheck.py: what one GPU can check of NCCL);
#   4. `single` in fp32, and in bf16 with full recomputation;
#   5. a one-rank launch.compare;
#   6. with 2 or more GPUs (always in the dry run, as gloo ranks of 4 "GPUs"): dp over every GPU, tp, every pipeline
#      schedule, zero3 and (with 4) 3d, each run's losses against single's; a rank that hangs, which must end
#      the job in one `error:` line; the network what-if on NVLink (the planner's dp layout on the h200's links);
#   7. figures.txt: one line of figures per run.
#
# PYTHON picks the interpreter (default: python); MODEL and STEPS the runs' size; GPU_CHECK_LOOPBACK (dry run)
# gives virtual time's loopback figures, as the test suite does.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
case "${1:-}" in
    --dry-run) DRY=1 ;;
    "") ;;
    *) echo "usage: bash launch/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python}
RESULTS=${GPU_CHECK_DIR:-${OUT:-runs}/gpu_check}
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
if [ "$DRY" -eq 1 ]; then
    BACKEND=gloo; NGPU=4; MODEL=${MODEL:-tiny}; STEPS=${STEPS:-4}; WARMUP=1
    DEVICE_ARGS=(parallel.backend=gloo)  # every rank on the CPU, as NCCL's would be on its GPU
    POSTING=(parallel.pp_posting=nccl)   # the pipelines post their sends and receives as they will on NCCL
    # Virtual time's loopback figures, where GPU_CHECK_LOOPBACK gives them (`virtual.loopback_*=...`, as the
    # test suite gives every run): the runs and the compare then probe nothing, as on NCCL; unset, each probes.
    read -r -a LOOPBACK <<< "${GPU_CHECK_LOOPBACK:-}"
else
    BACKEND=nccl; MODEL=${MODEL:-gpt2}; STEPS=${STEPS:-12}; WARMUP=4; DEVICE_ARGS=(); POSTING=(); LOOPBACK=()
    NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
fi
passed=0; failed=0; skipped=0

verdict() {  # verdict PASS|FAIL|SKIP NAME DETAIL
    printf '%-4s %-22s %s\n' "$1" "$2" "$3" | tee -a "$RESULTS/verdicts.txt"
    case $1 in PASS) passed=$((passed + 1)) ;; FAIL) failed=$((failed + 1)) ;; *) skipped=$((skipped + 1)) ;; esac
}

check() {  # check NAME TIMEOUT_S COMMAND...: run it, its output in NAME.log, one verdict from its exit status
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" >"$RESULTS/$name.log" 2>&1
    local rc=$?
    local last
    last=$(grep -v '^\s*$' "$RESULTS/$name.log" | tail -n 1 | cut -c1-110)
    if [ "$rc" -eq 0 ]; then verdict PASS "$name" "$last"
    elif [ "$rc" -eq 124 ]; then verdict FAIL "$name" "timed out after ${limit} s (log: $RESULTS/$name.log)"
    else verdict FAIL "$name" "exit $rc: $last (log: $RESULTS/$name.log)"; fi
}

expect_error() {  # expect_error NAME TIMEOUT_S COMMAND...: passes when the command fails in time with one `error:` line
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" >"$RESULTS/$name.log" 2>&1
    local rc=$? line
    line=$(grep -o -m 1 'error: rank [0-9]* stopped: .*' "$RESULTS/$name.log" | cut -c1-110)
    if [ "$rc" -eq 124 ]; then verdict FAIL "$name" "did not end within ${limit} s (log: $RESULTS/$name.log)"
    elif [ "$rc" -eq 0 ]; then verdict FAIL "$name" "exited 0: the fault did not stop the job"
    elif [ -n "$line" ]; then verdict PASS "$name" "exit $rc: $line"
    else verdict FAIL "$name" "exit $rc without the one-line error (log: $RESULTS/$name.log)"; fi
}

train() {  # train NAME RANKS OVERRIDES...: launch.train under torchrun, its run dir RESULTS/NAME
    local name=$1 ranks=$2
    shift 2
    check "$name" 600 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$ranks" -m launch.train \
        model="$MODEL" train.steps="$STEPS" train.warmup_steps="$WARMUP" train.global_batch="$BATCH" \
        "${DEVICE_ARGS[@]}" "${LOOPBACK[@]}" "$@" run.dir="$RESULTS/$name"
}

# 1. versions
"$PY" - "$DRY" <<'EOF' | tee "$RESULTS/machine.txt"
import platform, subprocess, sys
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| nccl", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None)
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print("gpus", len(gpus), gpus, "| bf16", torch.cuda.is_available() and torch.cuda.is_bf16_supported())
if sys.argv[1] == "1":
    print("dry run: every step on gloo and the CPU; no CUDA path is reached")
EOF
BATCH=$((8 * (NGPU > 2 ? NGPU : 2)))  # divisible by dp over every GPU and by every schedule's microbatches

# 2. the GPU tests (on the CPU they skip, each with its reason)
check pytest_gpu 600 "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider tests/

# 3. one rank on the backend: every call, every strategy
check selfcheck_$BACKEND 600 "$PY" -m launch.gpu_selfcheck --backend "$BACKEND"

# 4. single: the reference of every loss below, then bf16 with full recomputation
if [ "$DRY" -eq 1 ] || [ "$NGPU" -ge 1 ]; then
    train single_fp32 1 parallel=single
    train single_bf16_recompute 1 parallel=single train.precision=bf16 train.recompute=full
    # 5. a one-rank compare (its parent must not hold a GPU: its runs take them)
    check compare_1rank 600 "$PY" -m launch.compare model="$MODEL" compare.world=1 compare.strategies="[single]" \
        train.steps="$STEPS" train.warmup_steps="$WARMUP" "${LOOPBACK[@]}" run.dir="$RESULTS/compare_1rank"
else
    verdict SKIP single "no CUDA device is visible (bash launch/gpu_check.sh --dry-run runs the steps on the CPU)"
fi

# 6. two or more ranks on the backend, each against single
if [ "$NGPU" -ge 2 ]; then
    train dp "$NGPU" parallel=dp
    train tp 2 parallel=tp
    for schedule in pp_gpipe pp_1f1b pp_interleaved pp_zbh1 pp_zbv pp_dualpipev; do
        train "$schedule" 2 parallel="$schedule" "${POSTING[@]}"
    done
    train zero3 2 parallel=zero3
    if [ "$NGPU" -ge 4 ]; then train 3d 4 parallel=3d "${POSTING[@]}"; else verdict SKIP 3d "needs 4 GPUs (tp 2 x pp 2), $NGPU visible"; fi
    # A rank that hangs: the job ends in one `error:` line, not a watchdog abort (NCCL adds about a minute).
    expect_error fault_hang 240 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m launch.train \
        model=tiny train.steps=6 train.warmup_steps=1 parallel=dp parallel.timeout_s=10 "${DEVICE_ARGS[@]}" \
        train.fail_mode=hang train.fail_at_step=2 train.fail_rank=1 run.dir="$RESULTS/fault_hang"
    # What NVLink would make of the dp layout: the planner on the h200 cluster's links, beside the dp run above.
    check whatif_nvlink 300 "$PY" -m launch.plan model="$MODEL" cluster=h200 plan.world="$NGPU" "plan.layouts=[dp]" \
        run.dir="$RESULTS/whatif_nvlink"
else
    verdict SKIP multi_gpu "NCCL needs one GPU per rank: 2 or more for dp, tp, pipelines, zero3, 3d; $NGPU visible"
fi

# 7. every run's losses against single's, and its figures
if "$PY" -m launch.gpu_check_figures "$RESULTS" >"$RESULTS/figures.txt" 2>&1; then
    grep -vE '^(PASS|FAIL) ' "$RESULTS/figures.txt"
    while read -r word name rest; do verdict "$word" "$name" "$rest"; done < <(grep -E '^(PASS|FAIL) ' "$RESULTS/figures.txt")
else
    verdict FAIL figures "$(tail -n 1 "$RESULTS/figures.txt")"
fi

echo "gpu_check$([ "$DRY" -eq 1 ] && echo ' --dry-run'): $passed passed, $failed failed, $skipped skipped; results in $RESULTS"
[ "$failed" -eq 0 ]
