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
GO_SOURCES := $(shell find core transport capi -name '*.go' -not -name '*_test.go') go.mod go.sum

.PHONY: all deps build test test-go test-c test-python demo bench examples clean venv

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

build: $(LIB)
$(LIB): $(BUILD)/.deps $(GO_SOURCES) include/oktopk.h
	$(GO) build -buildmode=c-shared -o $(LIB) ./capi
	@rm -f $(BUILD)/liboktopk.h  # the public header is include/oktopk.h

venv: $(TORCH_VENV)/.ok
$(TORCH_VENV)/.ok: $(TORCH_REQ)
	@mkdir -p $(OKTOPK_CACHE)
	rm -rf $(TORCH_VENV).tmp
	python3 -m venv $(TORCH_VENV).tmp
	$(TORCH_VENV).tmp/bin/python -m pip install -q -r $(TORCH_REQ)
	rm -rf $(TORCH_VENV) && mv $(TORCH_VENV).tmp $(TORCH_VENV)
	@touch $@

test: test-go

test-go: $(BUILD)/.deps
	$(GO) vet ./...
	$(GO) test -race -count=1 -timeout 20m ./...

clean:
	rm -rf $(BUILD)
