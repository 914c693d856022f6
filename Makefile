# Two commands do all set-up on a fresh machine: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
MARIADB_URL ?= mysql://root@127.0.0.1:3306/taskplatform

.PHONY: run test chaos ablate check-run lint typecheck unit portable bench bench-beat soak install install-test clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info[:2] >= (3, 11), "Python 3.11+ is required"'
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-local: $(BIN)/python requirements/base.txt requirements/local.txt platform/pyproject.toml
	$(BIN)/pip install -q --disable-pip-version-check -r requirements/local.txt
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-local requirements/test.txt
	bin/system-deps
	$(BIN)/pip install -q --disable-pip-version-check -r requirements/test.txt
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed-test requirements/bench.txt
	$(BIN)/pip install -q --disable-pip-version-check -r requirements/bench.txt
	touch $@

install: $(VENV)/.installed-local
install-test: $(VENV)/.installed-test

## make run: venv, install, migrate, demo user, then web + worker + beat on the embedded profile
run: $(VENV)/.installed-local
	bin/run-embedded

## The PostgreSQL suite runs in two pytest-xdist processes (each its own test database, broker
## database and test-host subnet: config/settings/test.py, tests/chaos/hosts.py); most of its
## time is spent waiting on real workers and beats, not on the two cores. PYTEST_PARALLEL= runs it in one.
PYTEST_PARALLEL ?= -n 2 --dist worksteal

## make test: lint, types, the whole suite on PostgreSQL, the portable tests on SQLite and MariaDB (each in two
## processes too: 1.3 and 1.5 min against 2.6 and 2.8), then make run on a fresh clone
test: $(VENV)/.installed-test lint typecheck
	$(BIN)/pytest $(PYTEST_PARALLEL) --durations=25
	DATABASE_URL=sqlite:///$(CURDIR)/var/test-portable.sqlite3 $(BIN)/pytest $(PYTEST_PARALLEL) -m portable tests/ledger tests/locks tests/beat
	DATABASE_URL=$(MARIADB_URL) $(BIN)/pytest $(PYTEST_PARALLEL) -m portable tests/ledger tests/locks tests/beat
	bin/check-make-run
	$(BIN)/python bin/check-adoption

## make chaos: the whole fault catalogue (tests marked chaos, the slow ones included; docs/reliability.md)
## Its figures (var/chaos/figures.jsonl) become the table in docs/reliability.md (bin/catalogue).
chaos: $(VENV)/.installed-test
	rm -f var/chaos/figures.jsonl
	$(BIN)/pytest -m chaos -o addopts="-ra --strict-markers --import-mode=importlib -p no:cacheprovider" \
		--figures var/chaos/figures.jsonl tests; status=$$?; \
	$(BIN)/python bin/catalogue --figures var/chaos/figures.jsonl --write docs/reliability.md --check \
		&& exit $$status

## make soak: 1,000,000 executions through 2 workers, 2 beats and 3 producers under scheduled faults; the raw
## side-effect oracle must show 0 lost, 0 doubled atomic effects, every non-atomic re-run explained (docs/benchmarks.md)
SOAK_ARGS ?= --executions 1000000
soak: $(VENV)/.installed-bench
	$(BIN)/python bench/soak.py $(SOAK_ARGS) --workdir var/soak/work --plot docs/img/soak.png \
		--json var/soak/soak.json --markdown var/soak/soak.md

## make ablate: switch off each protocol guard in turn; a test must notice every one (docs/reliability.md)
ablate: $(VENV)/.installed-test
	$(BIN)/python bin/ablate --markdown var/ablation.md

## make check-run: `make run` on a fresh clone of HEAD: admin answers, Flower refuses anonymous, a job completes
check-run:
	bin/check-make-run

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy

## make bench: IdempotentTask (submit() and .delay()) vs plain Celery, django-celery-results, celery-once and
## Procrastinate, a fleet-wide limit on either lock backend, four bodies, medians of 3 interleaved rounds; then
## batch submission (docs/benchmarks.md)
BENCH_ARGS ?= --tasks 4000 --repeat 3 --variants plain,floor,floor_submit,floor_one,floor_submit_one,dcr,once,ledger,ledger_delay,procrastinate,limited,limited_redis \
	--bodies noop,cpu1ms,io10ms,write --body-variants plain,ledger,ledger_delay,procrastinate --body-tasks 1500
bench: $(VENV)/.installed-bench
	$(BIN)/python bench/run.py $(BENCH_ARGS) --json var/bench/run.json
	$(BIN)/python bench/submit_many.py --n 10000 --loop-n 2000 --rounds 3

## make bench-beat: DatabaseScheduler vs celery-redbeat vs LockedScheduler at 1,000 and 10,000 jobs (tick cost,
## lateness, failover); then LockedScheduler alone at 100,000 jobs of the mixed schedule (10 % every minute, the
## rest every 10 minutes, hourly or daily crons in six zones), its failover with those 100,000 (docs/benchmarks.md)
BEAT_ARGS ?= --jobs 1000,10000 --seconds 30
BEAT_SCALE_ARGS ?= --schedulers locked --jobs 100000 --mix --seconds 120 --failover-jobs 100000
bench-beat: $(VENV)/.installed-bench
	$(BIN)/python bench/beat.py $(BEAT_ARGS) --json var/bench/beat.json
	$(BIN)/python bench/beat.py $(BEAT_SCALE_ARGS) --json var/bench/beat-100k.json

clean:
	rm -rf $(VENV) var
