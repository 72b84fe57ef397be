# The two commands of the README. Each first installs what a fresh machine lacks, then runs cargo.
SHELL := /bin/bash
CARGO ?= cargo

.PHONY: demo test setup check bench guidellm

## Install system packages a fresh Debian/Ubuntu machine lacks (cmake and a C toolchain build
## pingora's dependencies). Skipped when already present.
setup:
	@missing=""; \
	command -v cmake >/dev/null 2>&1 || missing="$$missing cmake"; \
	command -v cc >/dev/null 2>&1 || missing="$$missing build-essential"; \
	command -v pkg-config >/dev/null 2>&1 || missing="$$missing pkg-config"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$missing; \
	fi
	@command -v $(CARGO) >/dev/null 2>&1 || { echo "cargo not found: install Rust from https://rustup.rs"; exit 1; }

## Simulated replicas, a replayed workload, and a report (see README).
demo: setup
	$(CARGO) run --release --locked -- demo

## The test suite.
test: setup
	$(CARGO) test --workspace --locked

## What CI runs besides the tests.
check: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

## Benchmarks recorded in docs/benchmarks.md.
bench: setup
	scripts/bench-sim.sh

## A real third-party client (guidellm) against the simulator; see docs/guidellm.md.
guidellm: setup
	$(CARGO) build --release --locked
	scripts/guidellm-run.sh
