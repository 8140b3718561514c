# trimlab: `make demo` runs the default experiment, `make test` runs every test.
# Both call `make setup`, which is idempotent: it installs only what is missing.
SHELL := /bin/bash
PYTHON ?= python3
RUNS ?= runs
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
APT_PACKAGES := clang llvm libbpf-dev bpftool iproute2 ethtool tcpdump openssh-server openssh-client gcc-multilib \
	tshark chromium
STAMP := $(VENV)/.trimlab-installed

.PHONY: setup apt venv test test-unit demo bench docs clean

setup: apt venv

# apt-get only when a package is missing, so a second run touches nothing.
apt:
	@missing=""; for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "setup: apt-get install$$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing; \
	else echo "setup: system packages present"; fi

# torch is installed first, pinned, so that the project's torch range is already met.
$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Strict editable mode: the package is a tree of links to the sources, a plain path that
# import-linter and IDEs follow. A file added, removed or renamed needs the tree rebuilt:
# the folders' modification times tell make when.
PACKAGE_DIRS := $(addsuffix /.,$(shell find core testbed agents analysis bench switch_configs playbooks experiments examples \
	-type d -not -name __pycache__ 2>/dev/null))

$(STAMP): pyproject.toml $(PACKAGE_DIRS) | $(PY)
	@echo "setup: torch $(TORCH_VERSION)"
	@$(PY) -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)')" 2>/dev/null \
	  || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	@echo "setup: trimlab and its dependencies (editable, strict)"
	@# (setuptools warns that a strict install is one: it is what we asked for)
	@PYTHONWARNINGS=ignore $(PY) -m pip install -q -e '.[dev]' --config-settings editable_mode=strict
	@touch $(STAMP)

venv: $(STAMP)
	@echo "setup: venv ready ($(VENV))"

# The unit tests run beside the rack and e2e tests, in a second pytest (niced: the rack
# tests come first on the CPU) whose log follows theirs: the rack tests spend most of their
# time waiting on their hosts, and no unit test builds a rack or binds outside loopback.
# The rack tests stay one at a time (racks share the management subnets, and commands
# without --id take the only rack up).
test: setup
	@unit_log=$$(mktemp); \
	nice -n 10 $(VENV)/bin/pytest -m unit -p no:cacheprovider > $$unit_log 2>&1 & unit=$$!; \
	$(VENV)/bin/pytest -m "not unit"; rack=$$?; \
	wait $$unit; unit_rc=$$?; \
	echo "== the unit tests (run beside the rack tests) =="; cat $$unit_log; rm -f $$unit_log; \
	echo "make test: rack and e2e tests exit $$rack, unit tests exit $$unit_rc"; \
	[ $$rack -eq 0 ] && [ $$unit_rc -eq 0 ]

test-unit: setup
	$(VENV)/bin/pytest -m unit

demo: setup
	$(VENV)/bin/trimlab demo --runs $(RUNS)

bench: setup
	$(VENV)/bin/trimlab bench codec --json

# the documentation site, served at http://127.0.0.1:8000 while you edit docs/
docs: setup
	$(VENV)/bin/mkdocs serve

clean:
	rm -rf $(VENV) .pytest_cache
