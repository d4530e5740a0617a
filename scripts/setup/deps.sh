#!/usr/bin/env bash
# Checks that the Debian / Ubuntu packages Ferry builds with are installed, and installs the missing
# ones when run as root. Works on Debian 12 and Ubuntu 24.04 (same package names on both).
#
#   scripts/setup/deps.sh            check; as root install what is missing; otherwise print the
#                                    exact `sudo apt-get install` command and exit 1
#   scripts/setup/deps.sh --dry-run  check and print what would be run, change nothing
#                                    (exit 1 if anything is missing)
#
# Environment:
#   FERRY_SKIP_DEPS=1       skip the check entirely (a non-Debian system with the libraries installed)
#   FERRY_DEPS_EXTRA="a b"  require these packages too (used to exercise the missing-package paths)
#
# The CUDA toolkit is optional and never installed here: when nvcc is on PATH or at
# /usr/local/cuda/bin/nvcc, the build compiles the CUDA backend; otherwise the host backend only.
#
# Exit status: 0 when everything is installed (or was just installed), 1 when something is missing
# and was not installed, 2 on a usage error.
set -euo pipefail

# What each package is for:
#   build-essential      g++ and make
#   cmake, ninja-build   the build (CMake >= 3.24: Debian 12 has 3.25, Ubuntu 24.04 has 3.28)
#   pkg-config           finds luajit, numa and libxxhash
#   libluajit-5.1-dev    the policy runtime and the `ferry` command (LuaJIT is embedded; the
#                        standalone `luajit` interpreter is not needed)
#   libabsl-dev          Status, strings, synchronization, flags
#   libnuma-dev          NUMA placement of pinned host memory
#   libgtest-dev, libgmock-dev  the tests
#   nlohmann-json3-dev   checkpoint manifests
#   libxxhash-dev        checkpoint checksums
#   clang libclang-rt-dev  libFuzzer, for the bounded fuzz run of the checkpoint parsers in `make test`
#   libopenmpi-dev openmpi-bin  the MPI comm and its mpirun tests (optional to the build: without MPI
#                        CMake leaves the MPI comm out; installed here so that CI runs those tests)
#   python3              the test that loads the installed libferry.so through ctypes (tests/install)
#   pybind11-dev         the `ferry` Python package's extension module (bindings/python)
#   python3-dev          the Python headers that extension compiles against
#   python3-torch        the Python package's tests and sample (ferry.torch.Optimizer vs torch.optim.AdamW)
#   python3-pytest       runs those tests (tests/python)
#   python3-venv python3-pip python3-setuptools python3-wheel  `pip install --no-build-isolation .`
#                        (pyproject.toml) and its CI test (tests/install: install.pip, into a venv)
readonly REQUIRED=(
  build-essential cmake ninja-build pkg-config libluajit-5.1-dev libabsl-dev libnuma-dev
  libgtest-dev libgmock-dev nlohmann-json3-dev libxxhash-dev clang libclang-rt-dev python3
  libopenmpi-dev openmpi-bin pybind11-dev python3-dev python3-torch python3-pytest
  python3-venv python3-pip python3-setuptools python3-wheel
)

dry_run=0
for arg in "$@"; do
  case "${arg}" in
    --dry-run) dry_run=1 ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "deps.sh: unknown argument '${arg}' (expected --dry-run or --help)" >&2; exit 2 ;;
  esac
done

if [[ "${FERRY_SKIP_DEPS:-0}" == "1" ]]; then
  echo "deps.sh: FERRY_SKIP_DEPS=1, not checking packages"
  exit 0
fi

packages=("${REQUIRED[@]}")
if [[ -n "${FERRY_DEPS_EXTRA:-}" ]]; then
  read -r -a extra <<<"${FERRY_DEPS_EXTRA}"
  packages+=("${extra[@]}")
fi

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "deps.sh: dpkg-query not found: this script knows Debian and Ubuntu only." >&2
  echo "Install the equivalents of: ${packages[*]}" >&2
  echo "then run with FERRY_SKIP_DEPS=1." >&2
  exit 1
fi

# A package counts as installed when dpkg says "install ok installed" (not merely known, or removed
# with its configuration files left behind).
missing=()
for p in "${packages[@]}"; do
  status="$(dpkg-query -W -f='${Status}' "${p}" 2>/dev/null || true)"
  if [[ "${status}" != "install ok installed" ]]; then missing+=("${p}"); fi
done

if command -v nvcc >/dev/null 2>&1; then
  cuda="nvcc at $(command -v nvcc) (the CUDA backend is built unless -DFERRY_ENABLE_CUDA=OFF)"
elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
  cuda="nvcc at /usr/local/cuda/bin/nvcc (the CUDA backend is built unless -DFERRY_ENABLE_CUDA=OFF)"
else
  cuda="no nvcc (optional; host backend only)"
fi

if (( ${#missing[@]} == 0 )); then
  echo "deps.sh: all ${#packages[@]} required packages are installed; CUDA: ${cuda}"
  exit 0
fi

echo "deps.sh: missing packages: ${missing[*]}"
install_cmd=(apt-get install -y --no-install-recommends "${missing[@]}")

if [[ "$(id -u)" != "0" ]]; then
  echo "deps.sh: not running as root; install them with:" >&2
  echo "sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi

# Package lists are fetched only when there are none (a fresh container) or when an install fails,
# which is what stale or absent lists cause.
lists_present() {
  compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null
}

if (( dry_run )); then
  lists_present || echo "would run: apt-get update   (no package lists yet)"
  echo "would run: DEBIAN_FRONTEND=noninteractive ${install_cmd[*]}"
  echo "   (and, if that fails, apt-get update and the install once more)"
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
if ! lists_present; then
  echo "deps.sh: no package lists yet: apt-get update"
  apt-get update
fi
echo "deps.sh: ${install_cmd[*]}"
if ! "${install_cmd[@]}"; then
  echo "deps.sh: install failed; refreshing package lists and trying once more"
  apt-get update || echo "deps.sh: apt-get update failed" >&2
  if ! "${install_cmd[@]}"; then
    echo "deps.sh: could not install: ${missing[*]}" >&2
    echo "  (on Ubuntu several of them are in the 'universe' component: add-apt-repository universe)" >&2
    exit 1
  fi
fi
echo "deps.sh: installed ${missing[*]}; CUDA: ${cuda}"
