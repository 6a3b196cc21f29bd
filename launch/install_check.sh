#!/usr/bin/env bash
# The project installs anywhere: `pip install .` (not editable) into a fresh virtual environment,
# then training started from another directory, with `python -m` and with the console script
# under `torchrun --no-python`. Run by .ci/run; about a minute on a fresh 2-core machine.
#
#   bash launch/install_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$PYTHON" -m venv "$work/venv"
pip_install() { "$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }
# The same torch rule as launch/setup.sh: the CPU build where no GPU is visible.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip_install "${TORCH_SPEC:-torch}"
else
    pip_install "${TORCH_SPEC:-torch==2.13.0}"
fi
pip_install .

run_dir="$work/runs"
cd "$work"  # far from the checkout: only the installed package can be found
export PATH="$work/venv/bin:$PATH"
small=(model=tiny train.steps=3 train.warmup_steps=1 data.max_bytes=1000000 train.peak_flops=1e11)
torchrun --standalone --nproc-per-node 2 -m launch.train parallel=dp "${small[@]}" run.dir="$run_dir/module" >/dev/null
torchrun --no-python --standalone --nproc-per-node 2 parallel-train parallel=tp "${small[@]}" run.dir="$run_dir/script" >/dev/null
for run in module script; do
    test -s "$run_dir/$run/summary.json" || { echo "install check: no summary.json from the $run run" >&2; exit 1; }
done
echo "install check: pip install . (non-editable) trains from $work with python -m and with parallel-train"
