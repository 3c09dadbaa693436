#!/usr/bin/env bash
# One-command set-up: installs hstu with the torch / fbgemm-gpu / torchrec trio that loads together
# on this machine (docs/design.md "Dependencies") and, on a CUDA machine, builds the compiled kernels.
#   bash scripts/install.sh          # runtime
#   bash scripts/install.sh --dev    # + pytest, ruff, CUTLASS headers (kernel compile checks)
# It installs into the ACTIVE Python environment ($PYTHON or python3); create and activate a
# virtual environment first (python3 -m venv .venv && . .venv/bin/activate). Never prompts.
# CPU machine : torch==2.13.0 (CPU) + fbgemm-gpu-cpu==1.8.0 + torchrec==1.8.0 (--no-deps)
# CUDA machine: the installed CUDA torch 2.(N+5) + fbgemm-gpu 1.N + torchrec 1.N, kernels built for
#               HSTU_CUDA_ARCH_LIST (default 8.0 = A100).
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=0
for a in "$@"; do
  case "$a" in
    --dev) DEV=1 ;;
    *) echo "usage: bash scripts/install.sh [--dev]" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --disable-pip-version-check -q)

# where the packages go: the active environment, no questions asked (CI runs this unattended)
env_prefix=$("$PY" -c "import sys; print(sys.prefix)")
in_venv=$("$PY" -c "import os, sys; print(int(sys.prefix != sys.base_prefix or 'CONDA_PREFIX' in os.environ))")
echo "[install] installing into the active Python environment: $env_prefix ($PY)"
if [ "$in_venv" != 1 ]; then
  echo "[install] not a virtual environment: to keep this project apart, create one first and re-run:" \
    "python3 -m venv .venv && . .venv/bin/activate (CUDA machine: add --system-site-packages to keep its torch)"
fi

have_cuda_torch() {
  "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null
}
torch_deps=(tensordict torchmetrics tqdm pyre-extensions iopath)

if have_cuda_torch && command -v nvidia-smi >/dev/null 2>&1; then
  tv=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
  minor=$(echo "$tv" | cut -d. -f2)
  fb="1.$((minor - 5))"
  echo "[install] CUDA torch $tv found: fbgemm-gpu $fb.*, torchrec $fb.*"
  "${PIP[@]}" "fbgemm-gpu==$fb.*" "${torch_deps[@]}"
  "${PIP[@]}" --no-deps "torchrec==$fb.*"
  "${PIP[@]}" "nvidia-cutlass==4.2.0.0"
  HSTU_CUDA_ARCH_LIST=${HSTU_CUDA_ARCH_LIST:-8.0} "${PIP[@]}" --no-build-isolation -e .
else
  echo "[install] CPU machine: torch 2.13.0 (CPU), fbgemm-gpu-cpu 1.8.0, torchrec 1.8.0"
  "${PIP[@]}" "torch==2.13.0"
  "${PIP[@]}" "fbgemm-gpu-cpu==1.8.0" "${torch_deps[@]}"
  "${PIP[@]}" --no-deps "torchrec==1.8.0"
  HSTU_SKIP_KERNELS=1 "${PIP[@]}" --no-build-isolation -e .
fi
if [ "$DEV" = 1 ]; then
  "${PIP[@]}" pytest ruff "nvidia-cutlass==4.2.0.0"
fi
"$PY" -c "import hstu, torch, torchrec, fbgemm_gpu, gin; print('[install] ok: hstu', hstu.__version__, 'torch', torch.__version__, 'torchrec', torchrec.__version__)"
