# tf-rdma: `make demo` runs the main job, `make test` runs the test suite.
# Both set everything up on a fresh Linux machine: system packages (apt),
# a virtual environment in .venv, TensorFlow, and the op library.

PYTHON ?= python3
TF_PACKAGE ?= tensorflow-cpu==2.21.0
VENV := .venv
VPY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-installed
BUILD_STAMP := $(VENV)/.tf_rdma-built
SOURCES := $(shell find kernels tf_rdma graph_passes -name '*.cc' -o -name '*.h' -o -name '*.py' 2>/dev/null) setup.py pyproject.toml

.PHONY: all install demo test test-fast bench bench-deps system-packages test-packages clean help fuzz softnic

all: install

help:
	@echo "make demo     set up, train the PS examples (gRPC vs @tf_rdma.rewrite; ParameterServerStrategy too), then Keras on 2 workers (RdmaStrategy vs MWMS)"
	@echo "make test     set up and run the test suite"
	@echo "make test-fast  only the in-process tests (passes, plan, settings, cost model; < 2 min)"
	@echo "make bench    run bench/p2p.py, allreduce.py and train.py (installs Open MPI + mpi4py) into bench/results/"
	@echo "make install  set up .venv and build the op library"
	@echo "make fuzz     fuzz the wire parsers and slot checks (libFuzzer with clang, installed if it can be; else a g++ driver); FUZZ_SECONDS=60"
	@echo "make cpp-test C++ unit tests of the engine pieces (wire, regions, config, slots, sha256, shm/tcp writes); g++, no TensorFlow; CPP_TEST_ARGS='NAME --list' filters"
	@echo "make softnic  build the emulated RDMA NIC (build/softnic/libibverbs.so.1, tests only) and the verbs conformance driver"
	@echo "make clean    remove build outputs (keeps .venv)"

# iproute2 for the network-namespace tests, g++ for the op library,
# libibverbs-dev for the verbs plugin (built and loaded by the tests; it
# carries data only where an RDMA NIC exists).
# Optional, each tried once (a stamp in build/), their tests skip without them:
# chromium for the test that loads `tf-rdma inspect --format html` in a
# headless browser (large, and not every distribution has it under that name);
# graphviz, whose `dot` lays out the HTML graph of `tf-rdma inspect` (without
# it the page uses its built-in layout, and the Graphviz tests skip);
# python3-pyverbs, the distribution's pyverbs matching its rdma-core, for
# `tf-rdma doctor` (docs/doctor.md; the PyPI pyverbs does not import on
# rdma-core 44).
CHROMIUM_TRIED := build/.chromium-tried
GRAPHVIZ_TRIED := build/.graphviz-tried
PYVERBS_TRIED := build/.pyverbs-tried

system-packages:
	@missing=""; \
	command -v ip >/dev/null 2>&1 || missing="$$missing iproute2"; \
	command -v g++ >/dev/null 2>&1 || missing="$$missing g++"; \
	[ -e /usr/include/infiniband/verbs.h ] || missing="$$missing libibverbs-dev"; \
	optional=""; \
	if ! command -v chromium >/dev/null 2>&1 && [ ! -e $(CHROMIUM_TRIED) ]; then optional="chromium"; fi; \
	if ! command -v dot >/dev/null 2>&1 && [ ! -e $(GRAPHVIZ_TRIED) ]; then optional="$$optional graphviz"; fi; \
	if ! dpkg -s python3-pyverbs >/dev/null 2>&1 && [ ! -e $(PYVERBS_TRIED) ]; then optional="$$optional python3-pyverbs"; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends $$missing || exit 1; \
	fi; \
	if [ -n "$$optional" ]; then \
	  mkdir -p build && touch $(CHROMIUM_TRIED) $(GRAPHVIZ_TRIED) $(PYVERBS_TRIED); \
	  if [ -n "$$SUDO" ]; then SUDO="sudo -n"; fi; \
	  { [ -n "$$missing" ] || $$SUDO apt-get update -qq; }; \
	  for pkg in $$optional; do \
	    echo "installing optional system package: $$pkg"; \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$pkg \
	      || echo "$$pkg not installed: the tests that need it will be skipped"; \
	  done; \
	fi

$(VPY):
	$(PYTHON) -m venv $(VENV)

# tf_keras (Keras 2) for the parameter-server tests and examples (Keras 3 has
# no ParameterServerStrategy fit, and places optimizer slots on the
# coordinator): the release of the installed TensorFlow's minor version,
# without its dependencies, which would pull `tensorflow` over
# `tensorflow-cpu`.
TF_MINOR = import importlib.metadata as m; \
  print(next("%s.%s.0" % tuple(d.version.split(".")[:2]) for d in m.distributions() \
             if (d.metadata["Name"] or "").lower().replace("_", "-") in ("tensorflow", "tensorflow-cpu")))
$(DEPS_STAMP): $(VPY) requirements-dev.txt Makefile
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TF_PACKAGE)" -r requirements-dev.txt
	$(VPY) -m pip install -q --no-deps "tf_keras~=$$($(VPY) -c '$(TF_MINOR)')"
	touch $@

$(BUILD_STAMP): $(DEPS_STAMP) $(SOURCES)
	$(VPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

install: system-packages $(BUILD_STAMP) softnic

# softnic (tests/softnic/softnic.h): an emulated RDMA NIC in user space, a
# drop-in libibverbs.so.1 with rdma-core's symbol versions, for the tests and
# for trying the verbs transport without a NIC; never a production path.
# LD_LIBRARY_PATH=$$PWD/build/softnic selects it for a process and its
# children (the plugin is not rebuilt). verbs_check is the driver of the
# verbs conformance suite (tests/test_verbs_conformance.py), linked to the
# system libibverbs so that it runs on real devices too. Skipped, with the
# reason, where <infiniband/verbs.h> is missing.
SOFTNIC_DIR := build/softnic
SOFTNIC_LIB := $(SOFTNIC_DIR)/libibverbs.so.1
SOFTNIC_CHECK := $(SOFTNIC_DIR)/verbs_check
SOFTNIC_SOURCES := $(wildcard tests/softnic/*.cc tests/softnic/*.h) tests/softnic/libibverbs.map

softnic: $(SOFTNIC_LIB) $(SOFTNIC_CHECK)

$(SOFTNIC_LIB): $(SOFTNIC_SOURCES) Makefile
	@mkdir -p $(SOFTNIC_DIR)
	@if [ -e /usr/include/infiniband/verbs.h ]; then \
	  echo "softnic: building $@ (emulated RDMA NIC, tests only)"; \
	  g++ -std=c++17 -O2 -g -fPIC -Wall -Wextra -Wno-unused-parameter -I. -shared \
	    -Wl,-soname,libibverbs.so.1 -Wl,--version-script=tests/softnic/libibverbs.map \
	    -Wl,--no-undefined tests/softnic/fabric.cc tests/softnic/verbs.cc \
	    -o $@.tmp -lpthread && mv -f $@.tmp $@; \
	else echo "softnic: <infiniband/verbs.h> is missing (libibverbs-dev): not built"; fi

$(SOFTNIC_CHECK): tests/conformance/verbs_check.c Makefile
	@mkdir -p $(SOFTNIC_DIR)
	@if [ -e /usr/include/infiniband/verbs.h ]; then \
	  gcc -std=c11 -O1 -g -Wall -Wextra -Wno-unused-parameter $< -o $@.tmp -libverbs && mv -f $@.tmp $@; \
	else echo "verbs_check: <infiniband/verbs.h> is missing (libibverbs-dev): not built"; fi

# The parameter-server example, trained through gRPC and through
# @tf_rdma.rewrite side by side: same losses, step times, speedup, plan; the
# same with TensorFlow's ParameterServerStrategy and ClusterCoordinator; then
# Keras fit on 2 workers with RdmaStrategy against MultiWorkerMirroredStrategy.
demo: install
	$(VENV)/bin/tf-rdma launch -n 1 --ps 1 -- $(VPY) examples/ps_training.py
	$(VENV)/bin/tf-rdma launch -n 2 --ps 2 --coordinator -- $(VPY) examples/ps_strategy.py
	$(VPY) examples/keras_digits.py --workers 2

# Slurm (slurm-wlm, munge) for the tests of `tf-rdma launch --slurm`, which
# start a one-node Slurm cluster of their own (tests/test_slurm.py); tried
# once, the tests skip with the reason without it. Not for `make demo`.
SLURM_TRIED := build/.slurm-tried
test-packages:
	@if ! command -v slurmctld >/dev/null 2>&1 && [ ! -e $(SLURM_TRIED) ]; then \
	  mkdir -p build && touch $(SLURM_TRIED); \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo -n"; fi; \
	  echo "installing optional system packages for the tests: slurm-wlm munge"; \
	  { $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends slurm-wlm munge; } \
	    || echo "slurm-wlm not installed: the Slurm tests will be skipped"; \
	fi

test: install test-packages
	$(VPY) -m pytest -q

# The edit-test loop: the graph passes, the plan, settings, cluster specs, the
# cost model and single-process op paths (tests marked `fast`), under 2 min.
test-fast: install
	$(VPY) -m pytest -q -m fast

# The collective benchmarks compare against Open MPI through mpi4py: installed
# here (not for `make test`); bench/allreduce.py skips MPI with the reason if
# they are missing.
bench-deps: install
	@if ! command -v mpirun >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openmpi-bin libopenmpi-dev \
	    || echo "Open MPI not installed: bench/allreduce.py will skip it"; \
	fi
	@$(VPY) -c "import mpi4py" 2>/dev/null || $(VPY) -m pip install -q mpi4py \
	  || echo "mpi4py not installed: bench/allreduce.py will skip Open MPI"

bench: bench-deps
	mkdir -p bench/results
	$(VPY) bench/p2p.py --json bench/results/p2p.json
	$(VPY) bench/allreduce.py --json bench/results/allreduce.json
	$(VPY) bench/train.py --json bench/results/train.json

clean:
	rm -rf build *.egg-info tf_rdma/_tf_rdma_ops.so tf_rdma/_tf_rdma_verbs.so tf_rdma/_tf_rdma_native.so tf_rdma/_build_info.json $(BUILD_STAMP)

# Fuzzing (tests/fuzz/wire_fuzz.cc says what and why). With clang, a
# libFuzzer target with ASan+UBSan runs for FUZZ_SECONDS over a corpus that
# starts from tests/fuzz/seeds; without it, the same target linked to
# tests/fuzz/standalone_main.cc (g++, ASan+UBSan) runs FUZZ_RUNS mutated
# inputs. `make fuzz` tries to install clang once (FUZZ_INSTALL=0: don't);
# tests/test_fuzz_targets.py runs a short `make fuzz FUZZ_INSTALL=0`.
FUZZ_SECONDS ?= 60
FUZZ_RUNS ?= 300000
FUZZ_INSTALL ?= 1
# The engine without the ops, the collectives and the C interface: every
# source of kernels/common and kernels/engine but those two, and the
# transports' core side (the verbs plugin itself needs libibverbs).
FUZZ_ENGINE := $(wildcard kernels/common/*.cc) \
  $(filter-out kernels/engine/c_api.cc kernels/engine/collective.cc,$(wildcard kernels/engine/*.cc)) \
  $(wildcard kernels/transport/*.cc kernels/transport/shm/*.cc kernels/transport/tcp/*.cc) \
  kernels/transport/verbs/factory.cc
FUZZ_FLAGS := -std=c++17 -O1 -g -I. -fno-omit-frame-pointer -fno-sanitize-recover=all
CLANG_TRIED := build/.clang-tried
# The g++ driver's sources compile in parallel, FUZZ_JOBS at a time (one
# object each under build/fuzz/obj, always rebuilt), then link.
FUZZ_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
FUZZ_STANDALONE_SRCS := tests/fuzz/wire_fuzz.cc tests/fuzz/standalone_main.cc $(FUZZ_ENGINE)
FUZZ_STANDALONE_OBJS := $(addprefix build/fuzz/obj/,$(subst /,_,$(FUZZ_STANDALONE_SRCS:.cc=.o)))

fuzz:
	@if ! command -v clang++ >/dev/null 2>&1 && [ "$(FUZZ_INSTALL)" = 1 ] && [ ! -e $(CLANG_TRIED) ]; then \
	  mkdir -p build && touch $(CLANG_TRIED); \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo -n"; fi; \
	  echo "installing clang for libFuzzer (once; FUZZ_INSTALL=0 skips)"; \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends clang libclang-rt-dev \
	    || echo "clang not installed: fuzzing with the g++ driver"; \
	fi
	@mkdir -p build/fuzz/corpus
	@if command -v clang++ >/dev/null 2>&1 && echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long){return 0;}' \
	      | clang++ -x c++ -fsanitize=fuzzer - -o build/fuzz/probe 2>/dev/null; then \
	  echo "fuzz: libFuzzer (clang), $(FUZZ_SECONDS) s"; \
	  clang++ $(FUZZ_FLAGS) -fsanitize=fuzzer,address,undefined tests/fuzz/wire_fuzz.cc $(FUZZ_ENGINE) \
	    -o build/fuzz/wire_fuzz -ldl -lpthread -lrt && \
	  cp -n tests/fuzz/seeds/* build/fuzz/corpus/ && \
	  build/fuzz/wire_fuzz -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 build/fuzz/corpus; \
	else \
	  echo "fuzz: no libFuzzer here; g++ driver with ASan+UBSan, $(FUZZ_RUNS) inputs"; \
	  mkdir -p build/fuzz/obj && \
	  printf '%s\n' $(FUZZ_STANDALONE_SRCS) | xargs -P $(FUZZ_JOBS) -I SRC sh -c \
	    'g++ $(FUZZ_FLAGS) -fsanitize=address,undefined -c SRC -o build/fuzz/obj/$$(echo SRC | tr / _ | sed "s/\.cc$$/.o/")' && \
	  g++ $(FUZZ_FLAGS) -fsanitize=address,undefined $(FUZZ_STANDALONE_OBJS) \
	    -o build/fuzz/wire_fuzz_standalone -ldl -lpthread -lrt && \
	  build/fuzz/wire_fuzz_standalone --runs=$(FUZZ_RUNS) tests/fuzz/seeds/*; \
	fi

# C++ unit tests of the engine pieces that need no TensorFlow (issue 14):
# tests/cpp/engine_unittest.cc, built with g++ from the fuzz target's engine
# sources (FUZZ_ENGINE) and run. Rebuilt only when a source under
# kernels/common, kernels/engine, kernels/transport or tests/cpp (or this
# Makefile) is newer than the binary. CPP_TEST_ARGS: test-name substrings,
# --list, --known-bugs. tests/test_cpp_units.py runs it in `make test` and `make test-fast`.
.PHONY: cpp-test
CPP_TEST_BIN := build/cpp/engine_unittest
# Its sources compile in parallel (FUZZ_JOBS at a time, into a folder of
# this build's own under build/cpp), then link.
CPP_TEST_SRCS := tests/cpp/engine_unittest.cc $(FUZZ_ENGINE)
CPP_TEST_ARGS ?=

cpp-test:
	@mkdir -p build/cpp
	@if [ ! -x $(CPP_TEST_BIN) ] || [ -n "$$(find Makefile kernels/common kernels/engine kernels/transport tests/cpp \( -name '*.cc' -o -name '*.h' -o -name Makefile \) -newer $(CPP_TEST_BIN) -print -quit)" ]; then \
	  echo "cpp-test: building $(CPP_TEST_BIN)"; \
	  tmp=$(CPP_TEST_BIN).tmp.$$$$; \
	  obj=build/cpp/obj.$$$$; rm -rf $$obj; mkdir -p $$obj && \
	  printf '%s\n' $(CPP_TEST_SRCS) | xargs -P $(FUZZ_JOBS) -I SRC sh -c \
	    "g++ -std=c++17 -O1 -g -I. -c SRC -o $$obj/\$$(echo SRC | tr / _).o" \
	    && g++ -std=c++17 -O1 -g $$obj/*.o -o $$tmp -ldl -lpthread -lrt \
	    && mv -f $$tmp $(CPP_TEST_BIN) || { rm -rf $$tmp $$obj; exit 1; }; \
	  rm -rf $$obj; \
	fi
	@$(CPP_TEST_BIN) $(CPP_TEST_ARGS)
