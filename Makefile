# Ferry: set-up, build and test entry points.
#
#   make demo      Release build of the `ferry` command in build/, then runs
#                  ./build/ferry run samples/quickstart.lua
#   make test      the CI build: build/ with warnings as errors (-DFERRY_WERROR=ON), every target,
#                  then every test (ctest, all cores); exits non-zero if anything fails
#   make fuzz      clang build of the checkpoint-parser fuzz target in build-fuzz/, run for 30 s
#                  (libFuzzer; part of `make test`)
#   make asan      AddressSanitizer + UBSan build in build-asan/ (-DFERRY_SANITIZE=ON), every test
#   make tsan      ThreadSanitizer build in build-tsan/ (-DFERRY_TSAN=ON, host backend only), every test
#   make gpu-test  the tests labelled `gpu`, in build/ (configured as by `make test` if it does not
#                  exist yet, else rebuilt as configured); they skip cleanly when no GPU is present
#   make clean     removes build/, build-asan/, build-tsan/ and build-fuzz/
#
# Every target first runs scripts/setup/deps.sh, which checks the Debian / Ubuntu packages: as root it
# installs what is missing, otherwise it prints the `sudo apt-get install` command and stops. So each
# target works on a fresh Debian 12 or Ubuntu 24.04 machine. FERRY_SKIP_DEPS=1 skips the check.
#
# CUDA is optional: the CUDA backend is built when nvcc is on PATH or at /usr/local/cuda/bin/nvcc.
# Variables: JOBS (parallel jobs; default all cores), CMAKE_ARGS (extra configure options, e.g.
# CMAKE_ARGS=-DFERRY_ENABLE_CUDA=OFF).

JOBS ?= $(shell nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
CMAKE_ARGS ?=

# CMake finds nvcc on PATH by itself; point it at the default toolkit location when it is only there.
ifeq ($(shell command -v nvcc 2>/dev/null),)
  ifneq ($(wildcard /usr/local/cuda/bin/nvcc),)
    CUDA_ARGS := -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc
  endif
endif

# Every configuration states all of Ferry's switches, so reusing a build directory configured by
# another target gives the same result as a fresh one.
CONFIGURE = cmake -S . -G Ninja $(CUDA_ARGS)
DEMO_ARGS = -DCMAKE_BUILD_TYPE=Release -DFERRY_WERROR=OFF -DFERRY_SANITIZE=OFF -DFERRY_TSAN=OFF
CI_ARGS   = -DCMAKE_BUILD_TYPE=Release -DFERRY_WERROR=ON -DFERRY_SANITIZE=OFF -DFERRY_TSAN=OFF
ASAN_ARGS = -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFERRY_WERROR=OFF -DFERRY_SANITIZE=ON -DFERRY_TSAN=OFF
# TSan: host backend only; the CUDA driver is not instrumented and would report false races.
TSAN_ARGS = -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFERRY_WERROR=OFF -DFERRY_SANITIZE=OFF -DFERRY_TSAN=ON \
            -DFERRY_ENABLE_CUDA=OFF

CTEST = ctest --output-on-failure -j$(JOBS)

# libFuzzer needs clang: only the fuzz target is built there, on the host backend.
FUZZ_ARGS = -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
            -DFERRY_WERROR=OFF -DFERRY_SANITIZE=OFF -DFERRY_TSAN=OFF -DFERRY_ENABLE_CUDA=OFF

.PHONY: help deps demo test fuzz asan tsan gpu-test clean

help:
	@sed -n '1,/^$$/p' Makefile | sed 's/^# \{0,1\}//'

deps:
	bash scripts/setup/deps.sh

demo: deps
	$(CONFIGURE) -B build $(DEMO_ARGS) $(CMAKE_ARGS)
	cmake --build build --target ferry -j$(JOBS)
	./build/ferry run samples/quickstart.lua

test: deps
	$(CONFIGURE) -B build $(CI_ARGS) $(CMAKE_ARGS)
	cmake --build build -j$(JOBS)
	$(CTEST) --test-dir build
	$(MAKE) --no-print-directory fuzz FERRY_SKIP_DEPS=1

fuzz: deps
	cmake -S . -G Ninja -B build-fuzz $(FUZZ_ARGS)
	cmake --build build-fuzz --target ckpt_safetensors_fuzz -j$(JOBS)
	$(CTEST) --test-dir build-fuzz -L fuzz --no-tests=error

# protect_shadow_gap=0 lets the CUDA driver map its memory under ASan (harmless without a GPU).
asan: deps
	$(CONFIGURE) -B build-asan $(ASAN_ARGS) $(CMAKE_ARGS)
	cmake --build build-asan -j$(JOBS)
	ASAN_OPTIONS=$${ASAN_OPTIONS:-protect_shadow_gap=0:detect_leaks=1} \
	UBSAN_OPTIONS=$${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
	$(CTEST) --test-dir build-asan

tsan: deps
	$(CONFIGURE) -B build-tsan $(TSAN_ARGS) $(CMAKE_ARGS)
	cmake --build build-tsan -j$(JOBS)
	TSAN_OPTIONS=$${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:history_size=7:suppressions=$(CURDIR)/tests/tsan.supp} \
	$(CTEST) --test-dir build-tsan

gpu-test: deps
	test -f build/build.ninja || $(CONFIGURE) -B build $(CI_ARGS) $(CMAKE_ARGS)
	cmake --build build -j$(JOBS)
	$(CTEST) --test-dir build -L gpu --no-tests=error

clean:
	rm -rf build build-asan build-tsan build-fuzz
