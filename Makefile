# The two commands of the README. Each first installs what a fresh machine lacks, then runs cargo.
SHELL := /bin/bash
CARGO ?= cargo
# Where cargo puts what it builds (CARGO_TARGET_DIR, when set, moves it).
TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)

.PHONY: demo test setup check check-deploy clients python-venv bench guidellm pgo

## Install system packages a fresh Debian/Ubuntu machine lacks (cmake and a C toolchain build
## pingora's dependencies; python3 runs the benchmark scripts and their tests). Skipped when
## already present.
setup:
	@missing=""; \
	command -v cmake >/dev/null 2>&1 || missing="$$missing cmake"; \
	command -v cc >/dev/null 2>&1 || missing="$$missing build-essential"; \
	command -v pkg-config >/dev/null 2>&1 || missing="$$missing pkg-config"; \
	command -v python3 >/dev/null 2>&1 || missing="$$missing python3"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$missing; \
	fi
	@command -v $(CARGO) >/dev/null 2>&1 || { echo "cargo not found: install Rust from https://rustup.rs"; exit 1; }

## Simulated replicas, a replayed workload, and a report (see README).
demo: setup
	$(CARGO) run --release --locked -- demo

## The test suite, and the tests of the benchmark scripts' own analysis.
test: setup
	$(CARGO) test --workspace --locked
	python3 -m unittest discover -s scripts -p 'test_*.py' -q

## What CI runs besides the tests.
check: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

## The deployment files: alert rules (promtool check + unit tests) and the Kubernetes manifests
## (rendered, then validated strictly against the Kubernetes schemas). Installs promtool (Debian's
## prometheus package) and kubernetes-validate (PyPI, in .cache/deploy-venv) when missing.
DEPLOY_VENV := .cache/deploy-venv
check-deploy: setup python-venv
	@command -v promtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends prometheus; }
	promtool check rules deploy/prometheus/alerts.yaml
	cd deploy/prometheus && promtool test rules alerts.test.yaml
	@[ -x $(DEPLOY_VENV)/bin/python ] || python3 -m venv $(DEPLOY_VENV)
	@$(DEPLOY_VENV)/bin/python -c "import kubernetes_validate, yaml" 2>/dev/null || \
	  $(DEPLOY_VENV)/bin/pip install -q kubernetes-validate==1.37.0 pyyaml
	$(CARGO) build --locked --bin headroom
	$(DEPLOY_VENV)/bin/python scripts/check_deploy.py --headroom $(TARGET_DIR)/debug/headroom

## The official OpenAI clients through the proxy, call by call against the same client straight to
## a simulated replica (docs/proxy.md#clients): Python's (PyPI `openai` and its dependencies, pinned
## by scripts/clients-requirements.txt, in .cache/clients-venv) and Node's (npm `openai`, pinned by scripts/clients-node/package-lock.json;
## Node.js and npm from apt when missing).
CLIENTS_VENV := .cache/clients-venv
clients: setup python-venv
	@[ -x $(CLIENTS_VENV)/bin/python ] || python3 -m venv $(CLIENTS_VENV)
	@$(CLIENTS_VENV)/bin/pip install -q --disable-pip-version-check -r scripts/clients-requirements.txt
	@{ command -v node && command -v npm; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends nodejs npm; }
	@major=$$(node -p 'process.versions.node.split(".")[0]'); \
	if [ "$$major" -lt 18 ]; then \
	  echo "make clients: Node.js $$(node --version) is too old (the check needs 18 or later; the pinned client supports 20 or later)" >&2; exit 1; \
	elif [ "$$major" -lt 20 ]; then \
	  echo "make clients: Node.js $$(node --version): older than the 20 the pinned client supports; checking anyway" >&2; \
	fi
	cd scripts/clients-node && npm ci --no-audit --no-fund --silent
	$(CARGO) build --locked --bin headroom
	@mkdir -p results/clients && $(CLIENTS_VENV)/bin/pip freeze >results/clients/pip-freeze.txt
	$(CLIENTS_VENV)/bin/python scripts/check_clients.py --headroom $(TARGET_DIR)/debug/headroom --out results/clients

## Python's venv module, which Debian ships apart (python3-venv).
python-venv:
	@python3 -c "import ensurepip, venv" 2>/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq python3-venv; }

## The proxy built with profile-guided optimisation, trained on simulated replicas
## (target/pgo/headroom; see docs/deployment.md).
pgo: setup
	scripts/build-pgo.sh

## Benchmarks recorded in docs/benchmarks.md.
bench: setup
	scripts/bench-sim.sh

## A real third-party client (guidellm) against the simulator; see docs/guidellm.md.
guidellm: setup
	$(CARGO) build --release --locked
	scripts/guidellm-run.sh
