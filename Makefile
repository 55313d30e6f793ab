# gpushare — operator and developer entry points. See README.md.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UV_VERSION := 0.13.9
# Tests own this folder (SQLite file, embedded Redis) unless DATABASE_URL / REDIS_URL are set.
TEST_VAR_DIR ?= var/test

.PHONY: run test lint bench install frontend image clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements/dev.lock
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	$(VENV)/bin/uv pip install -q -p $(PY) -r requirements/dev.lock
	touch $@

frontend: static/dist/app.js

static/dist/app.js: package.json package-lock.json $(wildcard static/src/*.js)
	npm ci --no-audit --no-fund --loglevel=error
	npm run build --silent

# The sandbox base image, built locally from busybox (no registry pulls); needs Docker.
image:
	bash scripts/build-sandbox-image.sh

run: install frontend
	$(PY) -m portal.launcher

test: install frontend
	GPUSHARE_VAR_DIR=$(TEST_VAR_DIR) bash scripts/run-tests.sh $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	DEBUG=true $(VENV)/bin/mypy .

# Where .ci/run builds the VM guest (QEMU's unprivileged user can read it there).
VM_IMAGES ?= /var/lib/libvirt/images/gpushare
VM_KERNEL ?= $(VM_IMAGES)/vmlinuz
VM_INITRD ?= $(VM_IMAGES)/initramfs.cpio.gz
# The benchmarked VMs run under TCG, as in CI; auto picks KVM where /dev/kvm can run guests.
LIBVIRT_DOMAIN_TYPE ?= qemu

bench: install
	$(PY) -m scheduler.bench --out BENCHMARKS.md
	GPUSHARE_VAR_DIR=var/test BENCH_OUT=BENCHMARKS.md VM_KERNEL=$(VM_KERNEL) VM_INITRD=$(VM_INITRD) \
		LIBVIRT_DOMAIN_TYPE=$(LIBVIRT_DOMAIN_TYPE) \
		$(PY) -m pytest -q -s -p no:cacheprovider -m bench tests/bench

clean:
	rm -rf var/test static/dist .pytest_cache .mypy_cache .ruff_cache
