#!/usr/bin/env bash
# Set up the project in a virtual environment (.venv by default) on a fresh machine.
#
#   bash launch/setup.sh            # then: .venv/bin/python -m pytest -q
#
# torch: where no NVIDIA GPU is visible, the CPU build torch==2.13.0 is installed first, so the
# project's unpinned `torch` requirement is already met and pip never downloads a multi-GB CUDA
# build. Where a GPU is visible, or torch is already in the environment, torch is left to you:
# set TORCH_SPEC (e.g. TORCH_SPEC="torch==2.13.0") and, if needed, TORCH_INDEX_URL to choose.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }

if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "setup: keeping torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
else
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        spec=${TORCH_SPEC:-torch}
        echo "setup: GPU found, installing $spec (set TORCH_SPEC / TORCH_INDEX_URL to pick a CUDA build)"
    else
        spec=${TORCH_SPEC:-torch==2.13.0}
        echo "setup: no GPU found, installing the CPU build $spec"
    fi
    pip_install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$spec"
fi

pip_install -e ".[dev,tensorboard]"
echo "setup: done. Activate with: source $VENV/bin/activate"
