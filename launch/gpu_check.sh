#!/usr/bin/env bash
# The one script a GPU machine runs for this project (a few minutes on one GPU):
#
#   bash launch/gpu_check.sh                 # results under runs/gpu_check/ (or $OUT/gpu_check)
#
#   1. the GPU-marked tests (pytest -m gpu), which skip with their reason where they cannot run;
#   2. short `single` runs on the GPU in fp32 and bf16 (model=small);
#   3. with 2+ GPUs: dp over all GPUs (fp32, bf16) and tp, pp at 2 GPUs, NCCL chosen automatically;
#      with 1 GPU: the same strategies as 2 gloo ranks on the CPU (NCCL needs a GPU per rank);
#   4. a short compare run (launch.compare, where the project has it);
#   5. figures.txt: one line per run (device, precision, tokens/s, step time, memory, MFU if known).
#
# Every step runs under a timeout and a failing step does not stop the others; the exit status
# is non-zero if any step failed. PYTHON picks the interpreter (default: python); MODEL, STEPS and
# WARMUP the runs' size (default: small, 20, 5; `MODEL=tiny STEPS=4 WARMUP=1` is a quick smoke test).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
RESULTS=${OUT:-runs}/gpu_check
mkdir -p "$RESULTS"
MODEL=${MODEL:-small}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-5}
failed=0

step() {  # step NAME TIMEOUT_S COMMAND...: run, log to $RESULTS/NAME.log, remember a failure
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" >"$RESULTS/$name.log" 2>&1
    local rc=$?
    echo "   exit $rc ($(tail -n 1 "$RESULTS/$name.log"))"
    [ "$rc" -eq 0 ] || failed=1
}

{
    date -u +"%Y-%m-%d %H:%M UTC"
    if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else echo "nvidia-smi: not available"; fi
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], "bf16", torch.cuda.is_available() and torch.cuda.is_bf16_supported())'
} | tee "$RESULTS/machine.txt"
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')

step pytest_gpu 900 "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider tests/

RUN="model=$MODEL train.steps=$STEPS train.warmup_steps=$WARMUP"
step single_fp32 300 "$PY" -m launch.train $RUN parallel=single run.dir="$RESULTS/single_fp32"
step single_bf16 300 "$PY" -m launch.train $RUN parallel=single train.precision=bf16 run.dir="$RESULTS/single_bf16"

if [ "$NGPU" -ge 2 ]; then
    TORCHRUN=("$PY" -m torch.distributed.run --standalone)
    DP_BATCH="train.global_batch=$((8 * NGPU))"  # divisible by any GPU count
    step dp_nccl 300 "${TORCHRUN[@]}" --nproc-per-node "$NGPU" -m launch.train $RUN parallel=dp $DP_BATCH run.dir="$RESULTS/dp_nccl"
    step tp_nccl 300 "${TORCHRUN[@]}" --nproc-per-node 2 -m launch.train $RUN parallel=tp run.dir="$RESULTS/tp_nccl"
    step pp_nccl 300 "${TORCHRUN[@]}" --nproc-per-node 2 -m launch.train $RUN parallel=pp_1f1b run.dir="$RESULTS/pp_nccl"
    step dp_nccl_bf16 300 "${TORCHRUN[@]}" --nproc-per-node "$NGPU" -m launch.train $RUN parallel=dp $DP_BATCH \
        train.precision=bf16 run.dir="$RESULTS/dp_nccl_bf16"
    COMPARE_WORLD=2  # every strategy's layout fits 2 ranks
else
    TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node 2)
    for s in dp tp pp_1f1b; do
        step "${s}_gloo_cpu" 300 "${TORCHRUN[@]}" -m launch.train $RUN parallel=$s parallel.backend=gloo run.dir="$RESULTS/${s}_gloo_cpu"
    done
    COMPARE_WORLD=1
fi

if [ -f launch/compare.py ]; then
    if [ "$COMPARE_WORLD" -ge 2 ]; then strategies="[single,dp,torch_ddp,tp,pp_1f1b]"; else strategies="[single]"; fi
    step compare 600 "$PY" -m launch.compare model="$MODEL" compare.world="$COMPARE_WORLD" compare.strategies="$strategies" \
        run.dir="$RESULTS/compare"
else
    echo "== compare: launch/compare.py is not in this checkout, skipped"
fi

"$PY" - "$RESULTS" <<'EOF' | tee "$RESULTS/figures.txt"
import json, pathlib, sys
print(f"{'run':<16} {'strategy':<10} {'world':>5} {'device':<6} {'prec':<5} {'tok/s':>10} {'step ms':>8} {'peak MB':>8} {'MFU':>6}")
root = pathlib.Path(sys.argv[1])
for path in sorted(root.rglob("summary.json")):
    s = json.loads(path.read_text())
    name = str(path.parent.relative_to(root))
    mfu = s.get("mfu")
    mfu = mfu.get("mfu") if isinstance(mfu, dict) else mfu
    print(f"{name:<16} {s['strategy']:<10} {s['world_size']:>5} {s.get('device', '?'):<6} {s.get('precision', '?'):<5} "
          f"{s['tokens_per_s']:>10.0f} {s['step_time_s'] * 1e3:>8.1f} {s['peak_memory_bytes'] / 1e6:>8.1f} "
          f"{'' if mfu is None else f'{100 * mfu:.1f}%':>6}")
EOF

echo "gpu_check: results in $RESULTS ($([ $failed -eq 0 ] && echo 'all steps passed' || echo 'SOME STEPS FAILED'))"
exit $failed
