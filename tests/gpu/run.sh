#!/usr/bin/env bash
# GPU end-to-end tests with the vLLM backend, on a machine with one CUDA GPU.
# Builds .venv-gpu (the project with the [test,vllm] extras; vllm brings its own CUDA torch),
# runs tests/gpu and prints a summary (per test: result, seconds, gen_logprob_abs_err per step).
#   tests/gpu/run.sh            # build/refresh the venv, run both tests
#   SKIP_INSTALL=1 tests/gpu/run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "tests/gpu/run.sh: no CUDA GPU here (nvidia-smi failed); nothing to run" >&2
  exit 2
fi
nvidia-smi -L

if [[ "${SKIP_INSTALL:-0}" != "1" ]]; then
  python3 -m venv .venv-gpu || exit 1
  .venv-gpu/bin/python -m pip install --quiet --upgrade pip || exit 1
  .venv-gpu/bin/python -m pip install --quiet -e ".[test,vllm]" || exit 1
fi
.venv-gpu/bin/python - <<'PY' || exit 1
import torch, vllm
assert torch.cuda.is_available(), "torch in .venv-gpu sees no CUDA device"
print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}, vllm {vllm.__version__}")
PY

log=$(mktemp -t nemo_rl_gpu_XXXX.log)
start=$(date +%s)
.venv-gpu/bin/python -m pytest -m gpu tests/gpu -v -s -rs --durations=0 -p no:cacheprovider 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
echo
echo "================ GPU summary ($(( $(date +%s) - start )) s, pytest exit $rc) ================"
grep -E "^tests/gpu/.*(PASSED|FAILED|SKIPPED|ERROR)" "$log" | sed 's/^/  /' || true
grep -E "^examples/configs/.*gen_logprob_abs_err" "$log" | sed 's/^/  /' || true
grep -E "^[0-9.]+s call .*tests/gpu" "$log" | sed 's/^/  /' || true
echo "full log: $log"
exit "$rc"
