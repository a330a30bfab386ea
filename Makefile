# `make test` on a fresh machine: creates .venv, installs the pinned requirements, runs every test.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-fast test-sbn venv bench clean

venv: $(STAMP)

# The pinned requirements' whole closure (requirements-lock.txt) installed by uv (pinned; pip puts it in
# $(VENV)/uv), which unpacks on every core and caches the unpacked wheels (~/.cache/uv); without uv, in 2
# concurrent pip processes; where the lock does not apply (another Python or platform, a stale lock), pip's
# resolver on requirements-test.txt (scripts/requirements_lock.py says when and why).
$(STAMP): requirements.txt requirements-test.txt requirements-lock.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) scripts/requirements_lock.py install
	# the project itself, editable (pyproject.toml): console commands, imports from anywhere; its
	# dependencies are the pinned ones just installed, and the venv's setuptools builds it (no download)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The whole suite, slow tests included (CI runs exactly this): the sync_batchnorm distribution's tests, then
# the app's; each prints its slowest tests at the end (what to look at when the suite grows). The app's tests
# run in TEST_WORKERS pytest-xdist processes (2: the CI machine's cores; tests/conftest.py shares the cores
# among them), file by file, the files with slow tests first (tests/conftest.py), so that a file's module
# fixtures run once and no long file runs alone at the end. The package's tests likewise (its conftest.py orders
# them the same way): their ranks start from a forkserver, and beside a compiled test's ranks, whose first one
# waits in a collective while the other still compiles, the short files fit (84-85 s against 106-112 s alone).
TEST_WORKERS ?= 2
# Bytecode caches (gitignored) are written even where the shell sets PYTHONDONTWRITEBYTECODE (this project's
# machines do): otherwise every test process compiles the project's modules again and every pytest worker
# rewrites every test file's assertions again (collecting the suite: 11.5 s with the variable, 5.8 s without).
unexport PYTHONDONTWRITEBYTECODE
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: $(STAMP) test-sbn
	$(PY) -m pytest -q $(XDIST) --durations=25 tests

# The sync_batchnorm distribution (model/sync_batchnorm/pyproject.toml) as its users get it: its wheel,
# installed in .venv-sbn, a venv that sees torch and pytest (with pytest-xdist) only (linked from $(VENV) by
# tests/linked_venv.py in a second, where installing torch again writes 4.5 GB), and its own tests
# (model/sync_batchnorm/tests, the original package's unchanged tests among them) against the installed package. -P: nothing of the
# checkout on sys.path. setuptools builds in the source folder: its build/ and egg-info are removed after.
SBN_VENV := .venv-sbn
test-sbn: $(STAMP)
	$(PY) -m tests.linked_venv $(SBN_VENV) torch pytest pytest-xdist
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir $(SBN_VENV)/wheel ./model/sync_batchnorm
	rm -rf model/sync_batchnorm/build model/sync_batchnorm/*.egg-info
	$(PY) -m pip --python $(SBN_VENV)/bin/python install --quiet --no-index $(SBN_VENV)/wheel/sync_batchnorm-*.whl
	$(SBN_VENV)/bin/python -P -m pytest -q $(XDIST) --durations=10 model/sync_batchnorm/tests

# Everything but the tests marked slow.
test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow" tests

# Every benchmark: each prints its table and writes JSON under benchmarks/results/, then one summary
# table of every target (PASS / FAIL / NOISY beside its A/A control). Each benchmark re-executes itself
# with MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ raised (stable CPU timings; benchmarks/common.py), except
# bench_vs_plain and bench_eval_vs_plain, which run train.py / eval.py and a plain loop in the environment a user's shell has.
BENCHMARKS := bench_syncbn bench_model bench_data bench_eval bench_train bench_stop bench_optim bench_host_syncs bench_vs_plain bench_eval_vs_plain
bench: $(STAMP)
	for name in $(BENCHMARKS); do $(PY) -m benchmarks.$$name || exit 1; done
	$(PY) -m benchmarks.summary

clean:
	rm -rf $(VENV) $(SBN_VENV) .pytest_cache model/sync_batchnorm/build model/sync_batchnorm/*.egg-info

# Train the CPU demo (synthetic shapes, configs/demo.yaml), then evaluate its best checkpoint with eval.py
# (prints the per-class table). Runs in runs/demo/.
.PHONY: demo
demo: $(STAMP)
	$(PY) train.py --config demo.yaml --resume auto
	$(PY) eval.py --checkpoint runs/demo/best.pt
