# gpushare — operator and developer entry points. See README.md.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UV_VERSION := 0.13.9
# Tests own this folder (SQLite file, embedded Redis) in the embedded pass.
TEST_VAR_DIR ?= var/test
# The PostgreSQL pass's servers: this machine's, a database and a Redis database the suite
# may empty (never Redis database 0).
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/gpushare
TEST_REDIS_URL ?= redis://127.0.0.1:6379/15
# Where scripts/setup-test-env.sh builds the VM guest (QEMU's unprivileged user can read it there).
VM_IMAGES ?= /var/lib/libvirt/images/gpushare
VM_KERNEL ?= $(VM_IMAGES)/vmlinuz
VM_INITRD ?= $(VM_IMAGES)/initramfs.cpio.gz
# The VMs run under TCG, as in CI; auto picks KVM where /dev/kvm can run guests.
LIBVIRT_DOMAIN_TYPE ?= qemu

.PHONY: run test test-fast screenshots setup-test lint bench bench-load twin install install-libvirt install-ldap frontend image clean

install: $(VENV)/.installed

# The command-line client (client/, its own package and lock) goes in too: `gpushare` on the
# venv's PATH, editable, its dependencies from its lock (which agrees with dev.lock).
$(VENV)/.installed: requirements/dev.lock client/requirements.lock client/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	$(VENV)/bin/uv pip install -q -p $(PY) -r requirements/dev.lock
	$(VENV)/bin/uv pip install -q -p $(PY) -r client/requirements.lock
	$(VENV)/bin/uv pip install -q -p $(PY) --no-deps -e ./client
	touch $@

# The libvirt sandbox driver's binding (VM isolation): only hosts that run VMs need it, and
# it builds against the libvirt headers (Debian: libvirt-dev pkg-config).
install-libvirt: $(VENV)/.installed-libvirt

$(VENV)/.installed-libvirt: $(VENV)/.installed requirements/libvirt.lock
	@pkg-config --exists libvirt || { echo "install-libvirt: the libvirt headers are missing: apt-get install -y libvirt-dev pkg-config"; exit 1; }
	$(VENV)/bin/uv pip install -q -p $(PY) -r requirements/libvirt.lock
	touch $@

# Sign-in with a directory password (LDAP_SERVER_URI): python-ldap builds against OpenLDAP's
# headers (Debian: libldap2-dev libsasl2-dev); a portal without LDAP does not need it.
install-ldap: $(VENV)/.installed-ldap

$(VENV)/.installed-ldap: $(VENV)/.installed requirements/ldap.lock
	@test -e /usr/include/ldap.h -a -e /usr/include/sasl/sasl.h || { echo "install-ldap: the OpenLDAP headers are missing: apt-get install -y libldap2-dev libsasl2-dev"; exit 1; }
	$(VENV)/bin/uv pip install -q -p $(PY) -r requirements/ldap.lock
	touch $@

frontend: static/dist/app.js

static/dist/app.js: package.json package-lock.json $(wildcard static/src/*.js)
	npm ci --no-audit --no-fund --loglevel=error
	npm run build --silent

# The sandbox base image, a Debian minbase built locally (no registry pulls); needs Docker.
image:
	bash scripts/build-sandbox-image.sh

run: install frontend
	$(PY) -m portal.launcher

# Everything the suite needs on this machine (packages, engines, images): idempotent.
setup-test:
	VM_KERNEL=$(VM_KERNEL) bash scripts/setup-test-env.sh

# The whole suite, twice where it touches the database: on PostgreSQL + Redis, and on the
# embedded default (SQLite + embedded Redis) that `make run` uses. CI=true: an engine that
# is missing fails its tests instead of skipping them (setup-test installed them all).
test: setup-test
	$(MAKE) --no-print-directory install-libvirt install-ldap frontend
	CI=$${CI:-true} TEST_DATABASE_URL=$(TEST_DATABASE_URL) TEST_REDIS_URL=$(TEST_REDIS_URL) \
		GPUSHARE_VAR_DIR=$(TEST_VAR_DIR) VM_KERNEL=$(VM_KERNEL) VM_INITRD=$(VM_INITRD) \
		LIBVIRT_DOMAIN_TYPE=$(LIBVIRT_DOMAIN_TYPE) bash scripts/run-tests.sh $(PYTEST_ARGS)

# The inner loop: every test that needs no engine, server or browser, on SQLite and the
# embedded Redis (DATABASE_URL and REDIS_URL unset), as any user: no root, no setup-test, no
# PostgreSQL or Redis server. About 4 minutes on 2 cores (3 min 52 s measured); `make test` runs these and the rest.
FAST_MARKERS := not slow and not e2e and not browser and not docker and not bwrap and not libvirt \
	and not races and not gpu and not bench
TEST_FAST_VAR_DIR ?= var/test-fast
# The embedded default (SQLite, the embedded Redis): no server named, not even as a secret file.
EMBEDDED := env -u DATABASE_URL -u DATABASE_URL_FILE -u REDIS_URL -u REDIS_URL_FILE
test-fast: install
	$(EMBEDDED) GPUSHARE_VAR_DIR=$(TEST_FAST_VAR_DIR) $(PY) -m pytest -m "$(FAST_MARKERS)" $(PYTEST_ARGS)

# The screenshots the README and docs/ show, renewed by the browser tests (tests/browser/),
# which otherwise write theirs under the run's var dir. Needs Chromium, Docker and bubblewrap
# (make setup-test installs them); runs on SQLite and the embedded Redis.
screenshots: install frontend
	$(EMBEDDED) GPUSHARE_VAR_DIR=$(TEST_VAR_DIR)-screenshots GPUSHARE_SCREENSHOTS=$(CURDIR)/docs/screenshots \
		CI=$${CI:-true} $(PY) -m pytest -m browser tests/browser $(PYTEST_ARGS)

# The openb cluster live (portal/twin): 1,213 simulated hosts on PostgreSQL and Redis, the
# trace's pods requested as sandboxes. Drops and creates TWIN_DATABASE_URL's database (its
# name must say "twin") and empties TWIN_REDIS_URL's Redis database. TWIN_ARGS: e.g.
# --no-departures --projects 1 (the comparison with the replay), or --days 7 --speed 336.
TWIN_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/gpushare_twin
TWIN_REDIS_URL ?= redis://127.0.0.1:6379/12
TWIN_OUT ?= var/twin
TWIN_ARGS ?= --days 7 --speed 336
twin: install
	DATABASE_URL=$(TWIN_DATABASE_URL) REDIS_URL=$(TWIN_REDIS_URL) GPUSHARE_VAR_DIR=$(TWIN_OUT)/var \
		SECRET_KEY=$$($(PY) -c 'import secrets; print(secrets.token_urlsafe(64))') \
		$(PY) manage.py twin --out $(TWIN_OUT) $(TWIN_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff format --check .
	DEBUG=true $(VENV)/bin/mypy .

bench: install-libvirt
	$(PY) -m scheduler.research.bench --out BENCHMARKS.md
	GPUSHARE_VAR_DIR=var/test BENCH_OUT=BENCHMARKS.md VM_KERNEL=$(VM_KERNEL) VM_INITRD=$(VM_INITRD) \
		LIBVIRT_DOMAIN_TYPE=$(LIBVIRT_DOMAIN_TYPE) \
		$(PY) -m pytest -q -s -p no:cacheprovider -m bench tests/bench tests/slurm/test_slurm_bench.py

# The load benchmark at USERS users and at 100 in the same run (tests/bench/test_load.py): every
# user with a sandbox page open, one in ten working; LOAD_SECONDS measured at each scale after a
# warm-up. On PostgreSQL and Redis (the test servers above), as deployed; rewrites its section
# of BENCHMARKS.md. `make bench` runs it at 100 users only.
USERS ?= 2000
LOAD_SECONDS ?= 300
bench-load: install
	CI=false DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) GPUSHARE_VAR_DIR=$(TEST_VAR_DIR)-load \
		LOAD_USERS=$(USERS) LOAD_SECONDS=$(LOAD_SECONDS) BENCH_OUT=BENCHMARKS.md \
		$(PY) -m pytest -q -s -p no:cacheprovider -m bench tests/bench/test_load.py

clean:
	rm -rf var/test static/dist .pytest_cache .mypy_cache .ruff_cache
