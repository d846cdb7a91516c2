# torch-kda: every target does its own set-up, so each works on a fresh machine.
#   make demo   - install everything, then run the main demo (python -m torch_kda demo), then `hf`
#   make test   - install everything, then run the Python and C++ test suites and check the wheels
#                 (native and pure-Python) installed into a separate venv
# Torch is pinned (torch==2.13.0, the CPU wheel kept on these machines): an unpinned resolve would
# download a multi-GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# on a machine where pip's default index would give the CUDA build.
TORCH_PIP_ARGS ?=
FLA_VERSION ?= 0.6.0
TRITON_VERSION ?= 3.9.0
JOBS ?= 2
BUILD_CPP := build/cpp
TORCH_PREFIX = $$($(PY) -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')

.PHONY: demo test setup install test-python test-cpp test-wheel bench check fuzz test-sanitize \
  test-clang test-aarch64 clean

# The installed console script (the package lives in src/, so the source tree never shadows it).
demo: install
	$(VENV)/bin/torch-kda demo
	@# A Hugging Face Kimi-Linear model: transformers' own KDA vs torch-kda (about half a minute).
	$(VENV)/bin/torch-kda hf

test: install test-python test-cpp test-wheel

# The CPU benchmark (docs/benchmarks.md) and the install check, through the installed command.
bench: install
	$(VENV)/bin/torch-kda bench

check: install
	$(VENV)/bin/torch-kda check

# --- set-up ---------------------------------------------------------------------------------------
$(PY):
	$(PYTHON) -m venv $(VENV)

# Python packages (torch pinned), CMake/Ninja for the native build, GoogleTest for the C++ suite.
$(VENV)/.setup-done: pyproject.toml Makefile | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION) $(TORCH_PIP_ARGS)
	$(PIP) install -q "scikit-build-core>=0.10" ninja "pytest>=7" "hypothesis>=6" numpy tqdm matplotlib einops
	@# transformers ships the Hugging Face Kimi-Linear model the weight converter is tested against.
	$(PIP) install -q transformers==5.24.0
	@# FLA's naive KDA is an independent test oracle, and torch_kda.integrations.fla plugs into FLA's
	@# backend registry; `import fla.ops.kda` needs Triton, whose PyPI wheel imports without a GPU.
	$(PIP) install -q --no-deps fla-core==$(FLA_VERSION)
	$(PIP) install -q triton==$(TRITON_VERSION)
	command -v cmake >/dev/null 2>&1 || $(PIP) install -q cmake
	@# GoogleTest from the system's package manager; where none works, the C++ suite's CMake
	@# builds the pinned googletest release from source (CMakeLists.txt, KDA_FETCH_GTEST).
	@if [ ! -f /usr/include/gtest/gtest.h ]; then \
	  if command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgtest-dev; \
	  elif command -v dnf >/dev/null 2>&1; then dnf install -y -q gtest-devel; \
	  elif command -v yum >/dev/null 2>&1; then yum install -y -q gtest-devel; \
	  elif command -v zypper >/dev/null 2>&1; then zypper --non-interactive install gtest; \
	  elif command -v apk >/dev/null 2>&1; then apk add --no-cache gtest-dev; \
	  elif command -v pacman >/dev/null 2>&1; then pacman -S --noconfirm --needed gtest; \
	  fi || true; \
	  [ -f /usr/include/gtest/gtest.h ] || echo "GoogleTest is not installed: the C++ suite's" \
	    "build will download and build googletest 1.15.2 (CMake FetchContent)"; \
	fi
	touch $@

setup: $(VENV)/.setup-done

# The package with its native operator, built against the installed torch (a failed native build
# is an error; TORCH_KDA_BUILD_EXT=0 would build the pure-Python package instead).
install: setup
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PIP) install -q --no-build-isolation --no-deps .

# --- tests ----------------------------------------------------------------------------------------
# From the repository root: the package lives in src/, so `import torch_kda` finds the installed one.
test-python: install
	$(PY) -m pytest -q -p no:cacheprovider tests

# The same library built by CMake alone, its GoogleTest suite (ctest), and the C++ example built
# against the installed CMake package with find_package(TorchKDA).
test-cpp: setup
	cmake -S . -B $(BUILD_CPP) -G Ninja -DCMAKE_BUILD_TYPE=Release -DKDA_BUILD_TESTS=ON \
	  -DCMAKE_PREFIX_PATH="$(TORCH_PREFIX)" -DPython3_EXECUTABLE=$(CURDIR)/$(PY) \
	  -DCMAKE_INSTALL_PREFIX=$(CURDIR)/$(BUILD_CPP)/install
	cmake --build $(BUILD_CPP) -j $(JOBS)
	cmake --install $(BUILD_CPP)
	ctest --test-dir $(BUILD_CPP) --output-on-failure
	cmake -S examples/cpp -B $(BUILD_CPP)/example -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_PREFIX_PATH="$(CURDIR)/$(BUILD_CPP)/install;$(TORCH_PREFIX)"
	cmake --build $(BUILD_CPP)/example -j $(JOBS)
	$(BUILD_CPP)/example/kda_example

# The wheels as a user gets them: the native wheel and the pure-Python one (TORCH_KDA_BUILD_EXT=0),
# each installed into a venv that holds only the pinned torch (made once: installing torch takes a
# minute) and checked there (tests/check_wheels.sh says what). The native wheel reuses the CMake
# build folder of `install`, so it costs a link and the packaging.
WHEEL_VENV := build/wheel-venv
$(WHEEL_VENV)/.torch-done: | $(PY)
	rm -rf $(WHEEL_VENV)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION) $(TORCH_PIP_ARGS)
	touch $@

test-wheel: install $(WHEEL_VENV)/.torch-done
	JOBS=$(JOBS) bash tests/check_wheels.sh $(PY) $(WHEEL_VENV) build/wheels

# Property tests at scale: thousands of hypothesis cases (profile "fuzz", tests/test_properties.py).
# FUZZ_EXAMPLES=N overrides the number of cases per property.
fuzz: install
	cd tests && KDA_HYPOTHESIS_PROFILE=fuzz ../$(PY) -m pytest -q -p no:cacheprovider test_properties.py

# The C++ library and its GoogleTest suite built with AddressSanitizer + UndefinedBehaviorSanitizer
# in their own build dir, then run; any report fails the run (libtorch itself is not instrumented,
# so leak detection, which would report libtorch's global allocations, is off).
BUILD_SAN := build/sanitize
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g
test-sanitize: setup
	cmake -S . -B $(BUILD_SAN) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKDA_BUILD_TESTS=ON \
	  -DCMAKE_PREFIX_PATH="$(TORCH_PREFIX)" -DPython3_EXECUTABLE=$(CURDIR)/$(PY) \
	  -DCMAKE_CXX_FLAGS="$(SAN_FLAGS)" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
	  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined"
	cmake --build $(BUILD_SAN) -j $(JOBS) --target kda_tests
	ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:detect_odr_violation=0 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 $(BUILD_SAN)/kda_tests --gtest_brief=1

# The C++ library, its GoogleTest suite and the C++ example built with Clang (the README names GCC
# or Clang; `make test` builds with the default compiler, GCC here), in build/clang. Clang's
# OpenMP runtime (libomp) comes from the system's package manager.
BUILD_CLANG := build/clang
test-clang: setup
	@if ! command -v clang++ >/dev/null 2>&1 || \
	  [ -z "$$(find /usr/lib /usr/lib64 -name libomp.so 2>/dev/null | head -1)" ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang libomp-dev; \
	fi
	cmake -S . -B $(BUILD_CLANG) -G Ninja -DCMAKE_BUILD_TYPE=Release -DKDA_BUILD_TESTS=ON \
	  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
	  -DCMAKE_PREFIX_PATH="$(TORCH_PREFIX)" -DPython3_EXECUTABLE=$(CURDIR)/$(PY)
	cmake --build $(BUILD_CLANG) -j $(JOBS)
	ctest --test-dir $(BUILD_CLANG) -j $(JOBS) --output-on-failure

# The C++ library, its GoogleTest suite and the C++ example cross-compiled for 64-bit ARM and run
# under QEMU (tests/cross/aarch64.sh: apt-get packages, libtorch from PyPI's aarch64 torch wheel).
test-aarch64: setup
	JOBS=$(JOBS) bash tests/cross/aarch64.sh $(PY) $(TORCH_VERSION) build/aarch64

clean:
	rm -rf build _skbuild dist *.egg-info
