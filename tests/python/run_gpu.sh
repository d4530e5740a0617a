#!/usr/bin/env bash
# The Python package on the GPU machine, in one command (from the repository root):
#
#   bash tests/python/run_gpu.sh [PYTHON]      PYTHON: the interpreter with torch 2.x and pybind11
#                                              (default: python3 on PATH)
#
# Configures and builds build-py-gpu/ (CUDA backend, the package for that interpreter), then runs
#   1. the pytest suites on CUDA tensors (FERRY_TEST_DEVICE=cuda) and on CPU tensors,
#   2. samples/python/gpt_sample.py --device cuda --check (both loss curves, their agreement),
#   3. samples/python/bench_step.py (1B params, fully offloaded: Python overhead vs the C++ step,
#      ratio to Megatron HDO's recorded 0.271 s).
# Exits non-zero when a build, a test or the sample's check fails (the bench asserts no timing).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
python="$(command -v "${1:-python3}")"
build="${FERRY_GPU_BUILD_DIR:-build-py-gpu}"
"${python}" -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'; print('torch', torch.__version__, torch.cuda.get_device_name())"
cmake -S . -B "${build}" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFERRY_WERROR=ON -DFERRY_PYTHON="${python}" \
  $( [[ -x /usr/local/cuda/bin/nvcc ]] && ! command -v nvcc >/dev/null && echo -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc )
cmake --build "${build}" --target ferry_python -j"$(nproc)"
export PYTHONPATH="${PWD}/${build}/python"
echo "== pytest, CUDA tensors"
FERRY_TEST_DEVICE=cuda "${python}" -m pytest -q -p no:cacheprovider -rs tests/python
echo "== pytest, CPU tensors"
"${python}" -m pytest -q -p no:cacheprovider tests/python
echo "== sample"
"${python}" samples/python/gpt_sample.py --device cuda --check
echo "== bench"
"${python}" samples/python/bench_step.py --device cuda
