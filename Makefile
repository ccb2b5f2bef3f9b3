# oktopk — build, test, demo, bench. A fresh machine needs nothing by hand:
# `make deps` installs what is missing, idempotently, and every target that
# needs it depends on it.

SHELL := /bin/bash
GO ?= go
BUILD := build
LIB := $(BUILD)/liboktopk.so
OKTOPK_CACHE ?= $(HOME)/.cache/oktopk
# The Python environment is keyed by its requirements, so changing them makes
# a new one and an unchanged file reuses the cached one.
TORCH_REQ := plugins/pytorch/requirements.txt
TORCH_VENV := $(OKTOPK_CACHE)/venv-torch-$(shell sha256sum $(TORCH_REQ) | cut -c1-12)
PY := $(TORCH_VENV)/bin/python
# Horovod's environment: its own torch (Horovod 0.28.1 builds only against
# torch <= 2.0.x) and Horovod built from source; keyed by its requirements and
# the Horovod version, cached beside the other one.
HOROVOD_VERSION := 0.28.1
HVD_REQ := plugins/horovod/requirements.txt
HVD_VENV := $(OKTOPK_CACHE)/venv-horovod-$(shell (cat $(HVD_REQ); echo $(HOROVOD_VERSION)) | sha256sum | cut -c1-12)
HVD_PY := $(HVD_VENV)/bin/python
# Tools for `make wheel` (auditwheel), keyed the same way.
WHEEL_REQ := plugins/wheel-requirements.txt
WHEEL_VENV := $(OKTOPK_CACHE)/venv-wheel-$(shell sha256sum $(WHEEL_REQ) | cut -c1-12)
WHEEL_PY := $(WHEEL_VENV)/bin/python
# The frameworks' environment (Transformers, Lightning, Accelerate,
# torchvision) over the plugin's torch: keyed by both requirements files,
# since it reads torch's packages from that virtualenv (venv-frameworks).
FW_REQ := plugins/frameworks-requirements.txt
FW_VENV := $(OKTOPK_CACHE)/venv-frameworks-$(shell cat $(FW_REQ) $(TORCH_REQ) | sha256sum | cut -c1-12)
FW_PY := $(FW_VENV)/bin/python
# A cached virtualenv is used only where it was built: its .ok marker is
# there and its activate script names this very folder. A cache moved, or
# reached through a link to another folder, keeps the old folder's name in
# every script; it is built again here rather than failing later.
venv_ready = { [ -f $(1)/.ok ] && grep -qs "^VIRTUAL_ENV=[\"']\?$(1)[\"']\?\$$" $(1)/bin/activate; }
GO_SOURCES := $(shell find core transport capi -name '*.go' -not -name '*_test.go') $(wildcard capi/*.c capi/*.h) go.mod go.sum

.PHONY: bits test-accuracy test-frameworks-setup test-frameworks-result test-beside-go beside-test-go-result venv-wait-torch venv-wait-horovod gpu-check all deps deps-launch deps-text deps-images bench-text bench-images bench-ddp bench-ddp-smoke venv-wheel build test test-go test-c test-launch test-python test-wheel test-venvs test-horovod test-frameworks venv-frameworks venv-wait-frameworks wheel demo demo-runs bench bench-quick bench-smoke bench-e2e bench-e2e-smoke bench-frameworks bench-go bench-scale bench-wire examples header-check clean venv venv-horovod print-py chaos chaos-smoke chaos-torch chaos-torch-smoke fuzz

all: build

deps: $(BUILD)/.deps
$(BUILD)/.deps: go.mod go.sum
	@mkdir -p $(BUILD)
	@if ! pkg-config --exists libzmq 2>/dev/null; then \
		echo "installing libzmq3-dev and pkg-config"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libzmq3-dev pkg-config >/dev/null; \
	fi
	$(GO) mod download
	@touch $@

# What the launch tests need besides libzmq: Open MPI (mpirun, mpicxx) and a
# single-node Slurm (slurmctld, slurmd, srun) with munge. Installed the same
# way, only what is missing:
# $(call apt-missing,tool:package[:package] ...) installs a tool's packages
# when the tool is not on PATH.
define apt-missing
	@missing=""; for pair in $(1); do \
		IFS=: read -r tool packages <<<"$$pair"; \
		command -v $$tool >/dev/null 2>&1 || missing="$$missing $${packages//:/ }"; \
	done; \
	missing=$$(printf '%s\n' $$missing | sort -u | xargs); \
	if [ -n "$$missing" ]; then \
		echo "installing $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
endef
LAUNCH_DEPS := mpicxx:openmpi-bin:libopenmpi-dev mpirun:openmpi-bin slurmctld:slurmctld slurmd:slurmd \
	srun:slurm-client munged:munge
deps-launch: $(BUILD)/.deps-launch
$(BUILD)/.deps-launch:
	@mkdir -p $(BUILD)
	$(call apt-missing,$(LAUNCH_DEPS))
	@touch $@

build: $(LIB)
$(LIB): $(BUILD)/.deps $(GO_SOURCES) include/oktopk.h capi/exports.map
	$(GO) build -buildmode=c-shared -ldflags="-extldflags=-Wl,--version-script=$(CURDIR)/capi/exports.map" -o $(LIB) ./capi
	@rm -f $(BUILD)/liboktopk.h  # the public header is include/oktopk.h

# The virtualenv's folder name carries the requirements' hash, so its marker
# file alone says it is complete (a fresh clone's newer file times must not
# trigger a reinstall). It is built in place, in the folder it will be used
# from: pip writes that folder into every script's first line (bin/pip,
# bin/torchrun), so a virtualenv built elsewhere and renamed has scripts
# that cannot start. The .ok marker is written last, so an interrupted
# build starts over. A virtualenv cached by an older Makefile, which built
# it in $(TORCH_VENV).tmp and renamed it, is repaired in place: the old
# folder's name is replaced in bin/ and pyvenv.cfg (once; after that there
# is nothing left to replace). --no-compile, then compileall on every core:
# pip byte-compiles the files one by one (a fresh torch virtualenv took 90 s
# with it, 50 s without). The bytecode must be written: where
# PYTHONDONTWRITEBYTECODE is set, Python never writes what it compiles on
# import, so without it every process compiles torch again (an import of
# torch took 7.4 s instead of 2.0, and test-python 873 s instead of ~540).
# compileall fails on a file or two written for newer Pythons (torch's
# py312_intrinsics.py, never imported here): that is not an error.
venv:
	@[ ! -d $(TORCH_VENV)/bin ] || grep -lIr --fixed-strings '$(TORCH_VENV).tmp' $(TORCH_VENV)/bin $(TORCH_VENV)/pyvenv.cfg \
		| xargs -r sed -i 's|$(TORCH_VENV)\.tmp|$(TORCH_VENV)|g'
	@if ! $(call venv_ready,$(TORCH_VENV)); then \
		set -e; mkdir -p $(OKTOPK_CACHE); rm -rf $(TORCH_VENV) $(TORCH_VENV).tmp; \
		echo "creating $(TORCH_VENV) from $(TORCH_REQ)"; \
		python3 -m venv $(TORCH_VENV); \
		$(PY) -m pip install -q --no-compile -r $(TORCH_REQ); \
		$(PY) -m compileall -q -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') > /dev/null || true; \
		touch $(TORCH_VENV)/.ok; \
	fi

# Horovod from source: Gloo for the collectives (horovodrun --gloo), no MPI,
# no TensorFlow or MXNet; its build requirements come from HVD_REQ because
# --no-build-isolation is what makes it compile against the torch installed.
# Compiled without debug information (tests/no_debug_info.sh says why).
# Built in place (console scripts such as horovodrun carry the venv's path);
# the .ok marker is written last, so an interrupted build starts over.
venv-horovod:
	@if ! $(call venv_ready,$(HVD_VENV)); then \
		set -e; mkdir -p $(OKTOPK_CACHE); rm -rf $(HVD_VENV); \
		echo "creating $(HVD_VENV) from $(HVD_REQ) and horovod==$(HOROVOD_VERSION) (a fresh machine builds Horovod once, several minutes)"; \
		python3 -m venv $(HVD_VENV); \
		$(HVD_PY) -m pip install -q --no-compile -r $(HVD_REQ); \
		HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
		HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=GLOO \
		CC="$(CURDIR)/tests/no_debug_info.sh gcc" CXX="$(CURDIR)/tests/no_debug_info.sh g++" \
		MAKEFLAGS=-j2 $(HVD_PY) -m pip install -q --no-build-isolation --no-cache-dir \
			horovod==$(HOROVOD_VERSION); \
		$(HVD_PY) -m compileall -q -j 0 $$($(HVD_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') > /dev/null || true; \
		$(HVD_VENV)/bin/horovodrun --check-build; \
		touch $(HVD_VENV)/.ok; \
	fi

# The frameworks' virtualenv, made as `venv` makes torch's (built in place,
# --no-compile then compileall, the .ok marker last), over torch's: a .pth
# file puts the torch virtualenv's site-packages after its own, so torch
# (about 5 GB with its CUDA libraries, on this index) is installed once, not
# twice. pip installs what the frameworks need into this virtualenv only:
# what test-python runs against never changes, and a package the torch
# virtualenv holds in another version is installed here, ahead of it.
venv-frameworks: venv
	@if ! $(call venv_ready,$(FW_VENV)); then \
		set -e; mkdir -p $(OKTOPK_CACHE); rm -rf $(FW_VENV); \
		echo "creating $(FW_VENV) from $(FW_REQ), over $(TORCH_VENV)"; \
		python3 -m venv $(FW_VENV); \
		$(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
			> $$($(FW_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/oktopk-torch-venv.pth; \
		$(FW_PY) -m pip install -q --no-compile -r $(FW_REQ); \
		$(FW_PY) -m compileall -q -j 0 $$($(FW_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') > /dev/null || true; \
		touch $(FW_VENV)/.ok; \
	fi

# Every test: each step in a make of its own, in this order, under
# tests/timed.sh, which writes the step's wall time to TEST_TIMES; `make
# test` ends with the table of them (on a failure, the table so far and the
# failing step's name). What is installed or built once and then cached
# (apt packages, Go modules, the library, the virtualenvs, Horovod's build)
# has a "setup:" line of its own, before the first suite that needs it; each
# suite's line holds its recipe and the builds only it uses (the examples,
# the wheels, the bench and chaos programs). A suite alone (`make
# test-python`) runs as before, untimed.
TEST_TIMES := $(BUILD)/test-times.txt
# The virtualenvs are built in the background from make test's start, at the
# lowest CPU priority, while the suites before them run (tests/background.sh);
# the step that needs one waits for it, then makes it (a no-op once built).
BACKGROUND := $(BUILD)/background
venv-wait-torch:
	@tests/background.sh $(BACKGROUND) wait torch-venv
	@$(MAKE) --no-print-directory venv
venv-wait-horovod:
	@tests/background.sh $(BACKGROUND) wait horovod-venv
	@$(MAKE) --no-print-directory venv-horovod
venv-wait-frameworks:
	@tests/background.sh $(BACKGROUND) wait frameworks-venv
	@$(MAKE) --no-print-directory venv-frameworks
# make test runs test-frameworks beside test-python, at the lowest CPU
# priority: test-python leaves about a quarter of the 2 cores idle (its
# ranks wait on each other), which the frameworks' suite takes; its output
# is printed whole, and its status counted, once test-python has ended.
test-frameworks-setup: venv-wait-frameworks deps-images deps-text
test-frameworks-result:
	@tests/background.sh $(BACKGROUND) result test-frameworks
# test-c, chaos-smoke and test-launch mostly wait, on their launchers,
# daemons and ranks' timeouts (measured alone: 42, 49 and 34 s of wall time
# for 12, 48 and 7 s of CPU), and test-go leaves about a third of the 2
# cores idle (263 s of wall time for 375 s of CPU from a cold Go cache): make
# test runs the three one after another beside test-go, at normal priority
# (background.sh beside), and prints their output, with each one's wall
# time, once test-go has ended. test-launch starts once torch's virtualenv
# is built (its Slurm job runs a DDP script); if that build failed, it does
# not run and make test stops there, naming the failed build. The smokes
# that compute stay after test-horovod: beside test-go they took 2 to 4
# times as long (results/first_hour.md).
BESIDE_GO_TIMES := $(BUILD)/beside-test-go-times.txt
BESIDE_GO := TIMED_TITLE="beside test-go" tests/timed.sh $(BESIDE_GO_TIMES)
test-beside-go:
	@tests/timed.sh $(BESIDE_GO_TIMES) reset
	-+@$(BESIDE_GO) run test-c $(MAKE) --no-print-directory test-c
	-+@$(BESIDE_GO) run chaos-smoke $(MAKE) --no-print-directory chaos-smoke
	-+@$(BESIDE_GO) run "test-launch (with the wait for torch's virtualenv)" \
		tests/background.sh $(BACKGROUND) after torch-venv $(MAKE) --no-print-directory test-launch
	@$(BESIDE_GO) print
beside-test-go-result:
	@tests/background.sh $(BACKGROUND) result beside-test-go
# $(call timed,NAME,TARGET): make TARGET, its wall time recorded as NAME.
# The + runs it under `make -n` too, so that the sub-make shows its recipe.
timed = +@tests/timed.sh $(TEST_TIMES) run "$(1)" $(MAKE) --no-print-directory $(2)
test:
	@tests/timed.sh $(TEST_TIMES) reset
	$(call timed,setup: libzmq and Go modules,deps)
	@tests/background.sh $(BACKGROUND) start torch-venv $(MAKE_COMMAND) --no-print-directory venv
	@tests/background.sh $(BACKGROUND) start horovod-venv $(MAKE_COMMAND) --no-print-directory venv-horovod
	@tests/background.sh $(BACKGROUND) start frameworks-venv \
		tests/background.sh $(BACKGROUND) after torch-venv $(MAKE_COMMAND) --no-print-directory venv-frameworks
	$(call timed,setup: liboktopk.so,build)
	$(call timed,setup: Open MPI and Slurm,deps-launch)
	@tests/background.sh $(BACKGROUND) beside beside-test-go $(MAKE_COMMAND) --no-print-directory test-beside-go
	$(call timed,test-go,test-go)
	$(call timed,test-c chaos-smoke test-launch (beside test-go; the wait for their end),beside-test-go-result)
	$(call timed,setup: torch venv (the wait for its background build),venv-wait-torch)
	@tests/background.sh $(BACKGROUND) start test-frameworks $(MAKE_COMMAND) --no-print-directory test-frameworks-setup test-frameworks
	$(call timed,test-python,test-python)
	$(call timed,test-frameworks (beside test-python; the wait for its end),test-frameworks-result)
	$(call timed,setup: wheel venv,venv-wheel)
	$(call timed,setup: horovod venv (the wait for its background build),venv-wait-horovod)
	$(call timed,test-wheel,test-wheel)
	$(call timed,test-horovod,test-horovod)
	$(call timed,test-venvs,test-venvs)
	$(call timed,bench-smoke,bench-smoke)
	$(call timed,setup: fortunes,deps-text)
	$(call timed,bench-e2e-smoke,bench-e2e-smoke)
	$(call timed,bench-ddp-smoke,bench-ddp-smoke)
	$(call timed,chaos-torch-smoke,chaos-torch-smoke)
	@tests/timed.sh $(TEST_TIMES) print

# Fuzz budgets are counts of executions, a few seconds each on a 2-core
# machine (make test's smoke of every decoder; `make fuzz` runs each for
# FUZZ_TIME), not durations: with a duration Go's fuzz coordinator can report a bare
# "context deadline exceeded" failure when the time runs out while a worker
# is mid-input (golang/go#75804, fixed only from Go 1.27), a failure with no
# input behind it.
FUZZ_DECODE_EXECS ?= 200000x
FUZZ_WIRE_EXECS ?= 60000x
FUZZ_PAYLOAD_EXECS ?= 30000x
FUZZ_TOPK_EXECS ?= 6000x
GO_TESTS_THAT_SHRINK := ^(TestDenseAllreduceOverZMQIsBitwiseSerialSum|TestSparseAlgorithmsOverZMQDensityOneEqualsDenseAverage|TestSparseAlgorithmsOverZMQRanksBitwiseIdentical|TestInProcAndZMQGiveEqualResultsAndTraffic)$$
test-go: $(BUILD)/.deps
	$(GO) vet ./...
	$(GO) test -race -count=1 -timeout 20m ./...
	@# The race detector slows code ~10x, so some tests shrink under it
	@# (raceEnabled); this pass runs them at the sizes the acceptance names:
	@# all of core's, and the collectives over ZeroMQ of tests/ (the rest of
	@# tests/, the fault tests, runs at full size under the race detector).
	$(GO) test -count=1 -timeout 20m ./core
	$(GO) test -count=1 -timeout 20m -run '$(GO_TESTS_THAT_SHRINK)' ./tests
	@# Fuzz the decoders of everything that comes off the wire, and selection.
	$(GO) test -run '^$$' -fuzz FuzzDecodeFrame -fuzztime $(FUZZ_DECODE_EXECS) ./transport
	$(GO) test -run '^$$' -fuzz '^FuzzInboxMessage$$' -fuzztime $(FUZZ_WIRE_EXECS) ./transport/zmq
	$(GO) test -run '^$$' -fuzz '^FuzzStoreMessage$$' -fuzztime $(FUZZ_WIRE_EXECS) ./transport
	$(GO) test -run '^$$' -fuzz '^FuzzSplitEndpoint$$' -fuzztime $(FUZZ_DECODE_EXECS) ./transport/zmq
	$(GO) test -run '^$$' -fuzz FuzzDecodeSparse -fuzztime $(FUZZ_DECODE_EXECS) ./core
	$(GO) test -run '^$$' -fuzz '^FuzzPeerPayload$$' -fuzztime $(FUZZ_PAYLOAD_EXECS) ./core
	$(GO) test -run '^$$' -fuzz '^FuzzTensorState$$' -fuzztime $(FUZZ_WIRE_EXECS) ./core
	$(GO) test -run '^$$' -fuzz FuzzTopK -fuzztime $(FUZZ_TOPK_EXECS) ./core

# Every decoder of bytes that come off the wire, fuzzed for FUZZ_TIME each:
# frame headers, the inbox's hello and authentication path, rendezvous store
# messages and endpoints, sparse payloads, every algorithm's use of peers'
# payloads, and tensor-state blobs. A duration is what is asked for here;
# tests/fuzz.sh tells a real finding (Go writes its input under testdata/fuzz)
# from the coordinator's bare "context deadline exceeded" at the end of a
# duration (golang/go#75804, see above).
FUZZ_TIME ?= 10m
FUZZ_TARGETS := transport:FuzzDecodeFrame transport/zmq:FuzzInboxMessage transport:FuzzStoreMessage \
	transport/zmq:FuzzSplitEndpoint core:FuzzDecodeSparse core:FuzzPeerPayload core:FuzzTensorState
fuzz: $(BUILD)/.deps
	GO=$(GO) tests/fuzz.sh $(FUZZ_TIME) $(FUZZ_TARGETS)

# The fault campaign (tests/cmd/chaos): real rank processes, in network
# namespaces when it can make them (root), CHAOS_FAULTS faults drawn from
# CHAOS_SEED over every algorithm and a float32 and a half dtype; it prints
# the table of fault kinds and writes it to CHAOS_OUT, the failing jobs' rank
# logs to $(BUILD)/chaos-logs, and fails on any hang, crash, wrong result,
# bad error, changed state or RSS over the bound. CHAOS_FLAGS passes more
# (e.g. -kinds sigkill,nan -v); `$(BUILD)/chaos run -h` lists them.
CHAOS_FAULTS ?= 500
CHAOS_SEED ?= 1
CHAOS_OUT ?= $(BUILD)/chaos.md
CHAOS_FLAGS ?=
$(BUILD)/chaos: $(BUILD)/.deps $(GO_SOURCES) $(wildcard tests/cmd/chaos/*.go tests/internal/*/*.go)
	$(GO) build -o $@ ./tests/cmd/chaos

chaos: $(BUILD)/chaos
	$(BUILD)/chaos run -faults $(CHAOS_FAULTS) -seed $(CHAOS_SEED) -out $(CHAOS_OUT) -logs $(BUILD)/chaos-logs $(CHAOS_FLAGS)

# A seeded slice of the campaign for `make test`: about 30 faults, every kind
# at least once (the link faults only where namespaces can be made; the
# report says SKIPPED otherwise), in about a minute.
CHAOS_SMOKE_FAULTS ?= 30
chaos-smoke: $(BUILD)/chaos
	timeout 170 $(BUILD)/chaos run -faults $(CHAOS_SMOKE_FAULTS) -seed $(CHAOS_SEED) -out $(BUILD)/chaos-smoke.md -logs $(BUILD)/chaos-smoke-logs

# The PyTorch plugin's fault campaign (tests/chaos_torch): real gloo process
# groups over 2-3 real rank processes (CPU, tiny models), CHAOS_TORCH_FAULTS
# faults drawn from CHAOS_TORCH_SEED into the plugin's own paths (the DDP
# hook's measured choice: native, sparse, bf16, quantized; its named
# algorithms; FSDP2; DeMo): SIGKILL and SIGSTOP of a rank, NaN and Inf in
# one rank's gradient, settings that differ across ranks, corrupted
# checkpoints, and resumes at every kind of step of the measured choice,
# each against the uninterrupted run bit for bit. It prints the table of
# fault kinds and writes it to CHAOS_TORCH_OUT, the failing jobs' rank logs
# to $(BUILD)/chaos-torch-logs, and fails on any hang, crash, silent
# divergence, unnamed error or changed state. CHAOS_TORCH_FLAGS passes more
# (e.g. --kinds sigkill,nan -v, or --job N to replay one job).
CHAOS_TORCH_FAULTS ?= 200
CHAOS_TORCH_SEED ?= 1
CHAOS_TORCH_OUT ?= $(BUILD)/chaos_torch.md
CHAOS_TORCH_FLAGS ?=
chaos-torch: $(LIB) venv
	$(PYENV) $(PY) tests/chaos_torch/campaign.py --seed $(CHAOS_TORCH_SEED) --faults $(CHAOS_TORCH_FAULTS) --out $(CHAOS_TORCH_OUT) --logs $(BUILD)/chaos-torch-logs $(CHAOS_TORCH_FLAGS)

# Every rank's gradients, parameters and residuals after every step of a
# fixed set of runs, for comparing two versions of the plugin bit for bit
# (docs/architecture.md): make bits BITS_OUT=before.json, then after.json,
# then tests/chaos_torch/bits.py compare before.json after.json.
BITS_OUT ?= $(BUILD)/bits.json
bits: $(LIB) venv
	$(PYENV) $(PY) tests/chaos_torch/bits.py record $(BITS_OUT)

# A seeded slice for `make test`: one job of every kind (about 20 faults),
# in well under two minutes.
chaos-torch-smoke: $(LIB) venv
	timeout 170 env $(PYENV) $(PY) tests/chaos_torch/campaign.py --smoke --seed $(CHAOS_TORCH_SEED) --out $(BUILD)/chaos-torch-smoke.md --logs $(BUILD)/chaos-torch-smoke-logs

# The C ABI's users: the C test program and the C++ trainer, linked against
# build/liboktopk.so with an rpath of $ORIGIN so they run from build/.
CC ?= gcc
CXX ?= g++
C_TEST := $(BUILD)/oktopk_test
TRAINER := $(BUILD)/trainer
RPATH := -Wl,-rpath,'$$ORIGIN'

examples: header-check $(C_TEST) $(TRAINER)

# The public header compiles cleanly as C99 and as C++17.
header-check: $(BUILD)/.header-ok
$(BUILD)/.header-ok: include/oktopk.h
	@mkdir -p $(BUILD)
	echo '#include "oktopk.h"' | $(CC) -std=c99 -Wall -Wextra -Wpedantic -Werror -Iinclude -x c -fsyntax-only -
	echo '#include "oktopk.h"' | $(CXX) -std=c++17 -Wall -Wextra -Wpedantic -Werror -Iinclude -x c++ -fsyntax-only -
	@touch $@

$(C_TEST): tests/c/oktopk_test.c include/oktopk.h $(LIB)
	$(CC) -std=c99 -O2 -Wall -Wextra -Werror -Iinclude $< -o $@ -L$(BUILD) -loktopk $(RPATH) -lpthread -lm

$(TRAINER): examples/cpp/trainer.cpp include/oktopk.h $(LIB)
	$(CXX) -std=c++17 -O2 -Wall -Wextra -Werror -Iinclude $< -o $@ -L$(BUILD) -loktopk $(RPATH) -lpthread

# The MPI example (unique id passed with MPI_Bcast), built wherever mpicxx
# exists: `make examples` includes it then, and test-launch installs Open MPI
# first and builds it in a second make, which looks for mpicxx again.
MPI_EXAMPLE := $(BUILD)/mpi_example
$(MPI_EXAMPLE): examples/cpp/mpi_example.cpp include/oktopk.h $(LIB)
	mpicxx -std=c++17 -O2 -Wall -Wextra -Werror -Iinclude $< -o $@ -L$(BUILD) -loktopk $(RPATH) -lpthread
ifneq ($(shell command -v mpicxx 2>/dev/null),)
examples: $(MPI_EXAMPLE)
endif

# C ABI tests: exported symbols, every error path, 1,000 init/destroy
# cycles, environment settings made after load, 4 ranks over real sockets, a
# rank that dies, then the trainer with 4 ranks.
test-c: examples
	tests/c/check_exports.sh $(LIB) include/oktopk.h
	timeout 120 $(C_TEST) errors
	timeout 120 $(C_TEST) cycles 300
	timeout 60 $(C_TEST) env
	timeout 120 tests/c/launch.sh 4 $(C_TEST) ranks
	timeout 120 tests/c/launch.sh 3 $(C_TEST) peerdeath
	timeout 120 tests/c/launch.sh 4 $(C_TEST) shrink
	timeout 120 tests/c/launch.sh 4 $(C_TEST) shrink stop
	timeout 120 tests/c/launch.sh 4 $(C_TEST) rejoin
	timeout 120 tests/c/launch.sh 4 $(C_TEST) rejoin stop
	timeout 120 tests/c/launch.sh 4 $(TRAINER)

# Real launchers (tests/launch/): the C++ trainer and the MPI example under
# Open MPI's mpirun -np 4; C ranks on two hosts (network namespaces) binding
# the address on the route to MASTER_ADDR, and failing, naming it, when a
# host advertises loopback; then a single-node Slurm made for the test runs
# srun -n 4 of the trainer and of a DDP script with the hook (skipped, saying
# why, where Slurm cannot start).
test-launch: $(BUILD)/.deps-launch examples venv
	$(MAKE) --no-print-directory $(MPI_EXAMPLE)
	tests/launch/mpirun.sh $(BUILD)
	tests/background_test.sh
	timeout 120 tests/launch/twohosts.sh $(C_TEST)
	timeout 600 tests/launch/slurm.sh $(BUILD) $(PY)

# The PyTorch plugin's tests: real multi-process DDP over gloo on CPU. The
# plugin is used from the repository (PYTHONPATH), finding build/liboktopk.so.
# The 15 slowest are named at the end: where make test's time goes.
# Two pytest workers (pytest-xdist): a test's ranks wait on each other and
# on timeouts, and the second worker's tests take that time (test-python
# alone on 2 cores: 429 s in one worker, 366 s in two; test-horovod 147 s,
# 115 s). Each test takes its own free ports (tests/python/conftest.py).
TEST_WORKERS ?= 2
PYENV := PYTHONPATH=$(CURDIR)/plugins/pytorch OMP_NUM_THREADS=1
test-python: $(LIB) venv
	$(PYENV) $(PY) -m pytest -q -rs -n $(TEST_WORKERS) --durations=15 -m "not accuracy" tests/python

# The hook under the frameworks, each as its package ships it (2 ranks, a
# few steps; examples/frameworks, docs/frameworks.md): Transformers' Trainer
# (the launcher, and a callback), Lightning's DDPStrategy, Accelerate's
# prepared module, torchvision's VGG-16 on Fashion-MNIST.
test-frameworks: $(LIB) venv-frameworks deps-images deps-text
	$(PYENV) $(FW_PY) -m pytest -q -rs tests/frameworks

# The wheels in fresh virtualenvs, with the system libzmq hidden: a 2-rank
# DDP step through the PyTorch plugin's, an import of the Horovod plugin's
# (tests/wheel/test_wheel.py says how).
test-wheel: wheel venv venv-horovod
	OKTOPK_HOROVOD_VENV=$(HVD_VENV) OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs tests/wheel

# The Horovod integration under real horovodrun --gloo (2 and 4 ranks).
test-horovod: $(LIB) venv-horovod
	OMP_NUM_THREADS=1 $(HVD_PY) -m pytest -q -rs -n $(TEST_WORKERS) -m "not accuracy" tests/horovod

# The accuracy checks make test leaves out (pytest's "accuracy" marker): the
# digits CNN trained 30 epochs densely and at 1% under DDP and under
# horovodrun, the sparse run within a point of the dense one. One seed
# each: a smoke alarm for a broken path, not a quality claim (results/
# holds those, over seeds); about three minutes together.
test-accuracy: $(LIB) venv venv-horovod
	$(PYENV) $(PY) -m pytest -q -rs -m accuracy tests/python
	OMP_NUM_THREADS=1 $(HVD_PY) -m pytest -q -rs -m accuracy tests/horovod

# Every script in the cached virtualenvs' bin/ runs (pip, torchrun,
# horovodrun, auditwheel, ...): their first lines name interpreters that
# exist.
test-venvs: venv venv-horovod venv-wheel
	tests/venv_scripts.sh $(TORCH_VENV) $(HVD_VENV) $(WHEEL_VENV)

# Plain DDP, then the hook with its defaults, on 4 ranks (bench/demo.sh): as
# root on links limited to DEMO_RATE (200mbit) in network namespaces, else on
# loopback. Prints both side by side, saves build/demo/demo.png, and ends
# with the wall time of each step, setup included (tests/timed.sh).
DEMO_TIMES := $(BUILD)/demo-times.txt
demo: export TIMED_TITLE = make demo
demo:
	@mkdir -p $(BUILD) && tests/timed.sh $(DEMO_TIMES) reset
	+@tests/timed.sh $(DEMO_TIMES) run "setup: libzmq and Go modules" $(MAKE) --no-print-directory deps
	+@tests/timed.sh $(DEMO_TIMES) run "setup: liboktopk.so" $(MAKE) --no-print-directory build
	+@tests/timed.sh $(DEMO_TIMES) run "setup: torch venv" $(MAKE) --no-print-directory venv
	+@tests/timed.sh $(DEMO_TIMES) run "the demo's two runs" $(MAKE) --no-print-directory demo-runs
	@tests/timed.sh $(DEMO_TIMES) print
demo-runs: $(LIB) venv
	bench/demo.sh $(PY) $(BUILD)/demo

# The DDP step matrix (bench/ddp_matrix.sh): plain DDP against the default
# hook and fixed sparse algorithms, 3 models x loopback, 1gbit, 200mbit at 4
# ranks and 200mbit at 8, 3 repeats in shuffled order; needs root for the
# emulated links. Writes results/ddp_matrix.{csv,md} and a bench.md section.
bench-ddp: $(LIB) venv
	bench/ddp_matrix.sh $(PY) results

# The step matrix's and the demo's scripts end to end on loopback, small
# (in make test: they must not rot between benchmark runs).
bench-ddp-smoke: $(LIB) venv
	BENCH_DDP_LINKS=loopback BENCH_DDP_P8_LINKS= BENCH_DDP_MODELS=cnn:1 BENCH_DDP_REPS=1 BENCH_DDP_STEPS=14 BENCH_DDP_SKIP=4 \
		BENCH_DDP_METHODS="ddp oktopk oktopk_oktopk" BENCH_LOGS=$(BUILD)/bench-ddp-smoke/logs \
		timeout 180 bench/ddp_matrix.sh $(PY) $(BUILD)/bench-ddp-smoke
	DEMO_MODE=loopback DEMO_WIDTH=64 DEMO_STEPS=12 timeout 180 bench/demo.sh $(PY) $(BUILD)/bench-ddp-smoke/demo

# The emulated-cluster benchmark (root: network namespaces and tc), every
# algorithm and torch gloo over P × n × density, plots, then time to
# accuracy (make bench-e2e; BENCH_E2E=0 skips it). Knobs: bench/run.sh's header
# (BENCH_P, BENCH_N, BENCH_DENSITY, BENCH_CONFIGS, BENCH_RATE, BENCH_ITERS,
# BENCH_MODE=loopback, ...). Writes results/.
BENCH_E2E ?= 1
$(BUILD)/benchrank: $(BUILD)/.deps $(GO_SOURCES) bench/cmd/benchrank/main.go
	$(GO) build -o $@ ./bench/cmd/benchrank

bench: $(LIB) venv $(BUILD)/benchrank
	BENCH_E2E=$(BENCH_E2E) bench/run.sh $(BUILD)/benchrank $(PY) results

bench-quick: $(LIB) venv $(BUILD)/benchrank
	BENCH_P="2 4" BENCH_N=262144 BENCH_DENSITY=0.01 BENCH_E2E=0 bench/run.sh $(BUILD)/benchrank $(PY) $(BUILD)/bench-quick

# Seconds: loopback (no root), n = 65536, P = 2, every algorithm and gloo,
# two repetitions in shuffled orders, three timed calls with τ′ = 2, τ = 3 so
# reuse, refresh and repartition all run; fails unless the CSV has a numeric
# row per algorithm out of a row per repetition. Never touches results/.
bench-smoke: venv $(BUILD)/benchrank
	BENCH_MODE=loopback BENCH_CONFIGS=2:65536:0.01 BENCH_REPS=2 BENCH_ITERS=3 BENCH_WARMUP=1 BENCH_DENSE_ITERS=2 \
		BENCH_TAU=3 BENCH_TAU_PRIME=2 BENCH_E2E=0 BENCH_LOGS=$(BUILD)/bench-smoke/logs \
		timeout 300 bench/run.sh $(BUILD)/benchrank $(PY) $(BUILD)/bench-smoke

# Time to accuracy on the emulated cluster (root: network namespaces and
# tc): the same model, seed and data trained under plain DDP,
# fp16_compress_hook, powerSGD_hook rank 1 and 4 and oktopk_hook (as a user
# gets it, algorithm="auto", a density schedule) for a step budget; training
# seconds and steps to a held-out accuracy, final accuracy, bytes per step.
# Writes results/tta.csv, tta_curve.csv, tta.png and a table in bench.md.
# Knobs: bench/ddp_e2e.sh's header (BENCH_E2E_P, BENCH_E2E_STEPS,
# BENCH_E2E_TARGET, BENCH_E2E_EVAL, BENCH_RATE, BENCH_MODE=loopback, ...).
bench-e2e: $(LIB) venv
	bench/ddp_e2e.sh $(PY) results

# The frameworks (VGG-16 under plain DDP, BERT under Trainer) plain against
# the one line, 4 ranks behind 200 Mbit/s links (netns: root), two orders;
# about 35 min on 2 cores (results/frameworks.md).
bench-frameworks: $(LIB) venv-frameworks deps-images deps-text
	bench/frameworks.sh $(FW_PY) build/bench-frameworks

# Seconds: loopback (no root), P = 2, every method once on a 9k-parameter
# MLP for 6 steps in the same two processes, target 0%; then the text
# benchmark's path (AdamW, clipping, a loss target, its plot) on a
# 141k-parameter transformer; fails unless each CSV has a row per method
# with every field a number. Never touches results/.
bench-e2e-smoke: $(LIB) venv deps-text
	BENCH_MODE=loopback BENCH_E2E_P=2 BENCH_E2E_WIDTH=64 BENCH_E2E_STEPS=6 BENCH_E2E_EVAL=3 BENCH_E2E_TARGET=0 \
		BENCH_E2E_POWERSGD_START=2 BENCH_E2E_SCHED_STEPS=2 BENCH_E2E_METHODS="ddp fp16 powersgd1 powersgd4 oktopk oktopk_auto oktopk_sched oktopk_w3 oktopk_oktopk_int8 oktopk_oktopk_int4" BENCH_E2E_STRICT=1 BENCH_E2E_TOGETHER=1 \
		BENCH_LOGS=$(BUILD)/bench-e2e-smoke/logs timeout 120 bench/ddp_e2e.sh $(PY) $(BUILD)/bench-e2e-smoke
	BENCH_MODE=loopback BENCH_E2E_P=2 BENCH_E2E_MODEL=charlm BENCH_E2E_NAME=text BENCH_E2E_WIDTH=48 BENCH_E2E_STEPS=6 BENCH_E2E_EVAL=3 \
		BENCH_E2E_TARGET=5.6 BENCH_E2E_POWERSGD_START=2 BENCH_E2E_METHODS="ddp powersgd4 oktopk oktopk_d5 oktopk_w3 demo" BENCH_E2E_STRICT=1 \
		BENCH_E2E_TOGETHER=1 BENCH_LOGS=$(BUILD)/bench-e2e-smoke/logs timeout 120 bench/ddp_e2e.sh $(PY) $(BUILD)/bench-e2e-smoke

# Real English text for the transformer benchmark and example
# (examples/pytorch/charlm.py): Debian's fortunes collection, installed when
# missing.
TEXT_CORPUS := /usr/share/games/fortunes
deps-text:
	@if [ ! -d $(TEXT_CORPUS) ]; then \
		echo "installing fortunes"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends fortunes >/dev/null; \
	fi

# Real photographs for the image benchmark (bench/ddp_e2e.py --model
# fashion): Fashion-MNIST as Debian's dataset-fashion-mnist ships it,
# installed when missing.
IMAGE_DATA := /usr/share/datasets/fashion-mnist
deps-images:
	@if [ ! -d $(IMAGE_DATA) ]; then \
		echo "installing dataset-fashion-mnist"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends dataset-fashion-mnist >/dev/null; \
	fi

# Time to accuracy for a CNN trained with SGD and momentum on real images
# (0.58M parameters, Fashion-MNIST, 1,200 steps of 64 images): dense, fp16,
# PowerSGD rank 4 and the hook with and without momentum correction at P = 4.
# Writes results/images.csv, images_curve.csv, images.png and a section of
# bench.md. results/images.md ran it on loopback with the sparse path forced:
# BENCH_MODE=loopback BENCH_IMAGES_ARGS="--algorithm oktopk".
BENCH_IMAGES_METHODS ?= ddp fp16 powersgd4 oktopk oktopk_nomc
BENCH_IMAGES_NAME ?= images
BENCH_IMAGES_ARGS ?=
bench-images: $(LIB) venv deps-images
	BENCH_E2E_MODEL=fashion BENCH_E2E_NAME=$(BENCH_IMAGES_NAME) BENCH_E2E_P=4 BENCH_E2E_STEPS=1200 BENCH_E2E_EVAL=100 \
		BENCH_E2E_TARGET=85 BENCH_E2E_POWERSGD_START=120 BENCH_E2E_ARGS="--batch-size 16 --lr 0.05 $(BENCH_IMAGES_ARGS)" \
		BENCH_E2E_METHODS="$(BENCH_IMAGES_METHODS)" bench/ddp_e2e.sh $(PY) results

# Time to a held-out loss for a transformer trained with AdamW on real text
# (examples/pytorch/charlm.py, 1.89M parameters): every method at P = 4 on
# the emulated cluster (BENCH_MODE=loopback: over loopback, for steps),
# powerSGD dense for the first 10% of the steps as torch's documentation
# suggests. Writes results/text.csv, text_curve.csv, text.png and a section
# of bench.md (BENCH_TEXT_NAME=text_loopback for the loopback run).
BENCH_TEXT_METHODS ?= ddp fp16 powersgd1 powersgd4 oktopk oktopk_d5 oktopk_w40
BENCH_TEXT_STEPS ?= 400
BENCH_TEXT_TARGET ?= 2.3
BENCH_TEXT_NAME ?= text
bench-text: $(LIB) venv deps-text
	BENCH_E2E_MODEL=charlm BENCH_E2E_NAME=$(BENCH_TEXT_NAME) BENCH_E2E_P=4 BENCH_E2E_STEPS=$(BENCH_TEXT_STEPS) BENCH_E2E_EVAL=25 \
		BENCH_E2E_TARGET=$(BENCH_TEXT_TARGET) BENCH_E2E_POWERSGD_START=$$(( $(BENCH_TEXT_STEPS) / 10 )) BENCH_E2E_ARGS="--batch-size 16" \
		BENCH_E2E_METHODS="$(BENCH_TEXT_METHODS)" bench/ddp_e2e.sh $(PY) results

# Go benchmarks: transport beside raw ZeroMQ, and the collectives in process.
bench-go: $(BUILD)/.deps
	$(GO) test -run '^$$' -bench TransferOverLoopback -benchtime 10x ./transport/zmq
	$(GO) test -run '^$$' -bench RingAllreduceBetweenProcesses -benchtime 1x ./tests
	$(GO) test -run '^$$' -bench . -benchtime 10x ./core

# The real collectives' traffic at up to 1,024 ranks in one process
# (bench/cmd/scale: core's code over the in-process transport, no network):
# words and messages per rank and phase of Ok-Topk, TopkA, TopkDSA, gTopk
# and the dense ring and Rabenseifner, on gradients recorded from the MLP,
# the CNN and the transformer at steps 1, 50 and 200 (bench/scale_record.py,
# into build/scale/grads, once) and on uniform ones. Writes
# results/scale_traffic.csv and results/scale.md's tables to
# build/scale/tables.md. SCALE_P: the rank counts; SCALE_FLAGS: more
# (`build/scale/scale -h`).
SCALE_P ?= 2,4,8,16,64,256,1024
SCALE_FLAGS ?=
$(BUILD)/scale/scale: $(BUILD)/.deps $(GO_SOURCES) $(wildcard bench/cmd/scale/*.go)
	$(GO) build -o $@ ./bench/cmd/scale

$(BUILD)/scale/grads/.ok: bench/scale_record.py | venv deps-text
	OMP_NUM_THREADS=1 $(PY) bench/scale_record.py --out $(BUILD)/scale/grads
	@touch $@

bench-scale: $(BUILD)/scale/scale $(BUILD)/scale/grads/.ok
	$(BUILD)/scale/scale -grads $(BUILD)/scale/grads -p $(SCALE_P) -csv results/scale_traffic.csv -md $(BUILD)/scale/tables.md $(SCALE_FLAGS)

# Bytes per selected entry on the wire (bench/cmd/wire: Ok-Topk on the same
# recorded gradients with float32, 8-bit and 4-bit values, every sparse
# frame parsed, beside the entropy bound), then the codec's time per entry;
# results/wire.md. WIRE_P: the rank counts.
WIRE_P ?= 8,64
bench-wire: $(BUILD)/scale/grads/.ok
	$(GO) run ./bench/cmd/wire -grads $(BUILD)/scale/grads -p $(WIRE_P) -md $(BUILD)/scale/wire_bytes.md
	$(GO) test -run '^$$' -bench BenchmarkSparseCodec -benchtime 100x -count 6 ./core

# The CUDA checks, on a machine with a GPU and no Go or registries: from the
# wheel `make wheel` built beforehand (tests/gpu_check.sh says how).
gpu-check:
	bash tests/gpu_check.sh

print-py:
	@echo $(PY)

# The wheels a user installs with pip: the PyTorch plugin's, carrying
# liboktopk.so and, grafted in by auditwheel (which renames them and points
# the library at them), libzmq and the libraries it links, so
# it needs no system libzmq and is tagged manylinux; and the Horovod
# plugin's (pure Python). Written to build/wheels/. Both are built from a
# copy of the plugin folders, so the source tree gets no build/ or
# egg-info. tests/wheel/ installs them into a fresh virtualenv.
WHEEL_DIR := $(BUILD)/wheels
PLUGIN_FILES := $(shell find plugins/pytorch plugins/horovod -type f \( -name '*.py' -o -name '*.toml' \) -not -path '*/__pycache__/*')
venv-wheel:
	@if ! $(call venv_ready,$(WHEEL_VENV)); then \
		set -e; mkdir -p $(OKTOPK_CACHE); rm -rf $(WHEEL_VENV); \
		echo "creating $(WHEEL_VENV) from $(WHEEL_REQ)"; \
		python3 -m venv $(WHEEL_VENV); \
		$(WHEEL_PY) -m pip install -q --no-compile -r $(WHEEL_REQ); \
		touch $(WHEEL_VENV)/.ok; \
	fi
wheel: $(WHEEL_DIR)/.ok
$(WHEEL_DIR)/.ok: $(LIB) $(PLUGIN_FILES) $(WHEEL_REQ) | venv-wheel
	rm -rf $(WHEEL_DIR) $(BUILD)/wheel-src && mkdir -p $(BUILD)/wheel-src
	cp -r plugins/pytorch plugins/horovod $(BUILD)/wheel-src/
	@# setuptools' own build/ from an earlier pip install of the checkout
	@# would win over the sources (copied later, so older): never carry it.
	rm -rf $(BUILD)/wheel-src/*/build $(BUILD)/wheel-src/*/*.egg-info
	OKTOPK_LIBRARY=$(CURDIR)/$(LIB) $(WHEEL_PY) -m pip wheel -q --no-deps --no-build-isolation \
		-w $(BUILD)/wheel-src/raw $(BUILD)/wheel-src/pytorch
	PATH=$(WHEEL_VENV)/bin:$$PATH $(WHEEL_PY) -m auditwheel repair -w $(WHEEL_DIR) $(BUILD)/wheel-src/raw/oktopk-*.whl
	$(WHEEL_PY) -m pip wheel -q --no-deps --no-build-isolation -w $(WHEEL_DIR) $(BUILD)/wheel-src/horovod
	@ls $(WHEEL_DIR)
	@touch $@

# Builds liboktopk.so and pip-installs the PyTorch plugin with the library
# inside it, into INSTALL_PY's environment (the python on PATH by default:
# an activated virtualenv, say). plugins/pytorch/setup.py copies the library
# into the wheel.
INSTALL_PY ?= python3
.PHONY: install-python
install-python: $(LIB)
	$(INSTALL_PY) -m pip install ./plugins/pytorch

clean:
	rm -rf $(BUILD)
