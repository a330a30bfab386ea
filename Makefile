# `make test` on a fresh machine: creates .venv, installs the pinned requirements, runs every test.
# What each target does and what it costs: docs/maintainers.md, "Tests and CI".
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-fast test-sbn venv bench clean

venv: $(STAMP)

# The lock's whole closure (requirements-lock.txt), by uv where it can be installed, else by pip
# (scripts/requirements_lock.py says which and why), then syncseg itself, editable, built by the venv's
# setuptools without a download.
$(STAMP): requirements.txt requirements-test.txt requirements-lock.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) scripts/requirements_lock.py install
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The whole suite, slow tests included (CI runs exactly this): the sync_batchnorm distribution's tests, then
# the app's, each in TEST_WORKERS pytest-xdist processes, file by file (a file's module fixtures run once;
# tests/conftest.py hands out the files with slow tests first and shares the cores among the workers).
TEST_WORKERS ?= 2
# bytecode caches are written even where the shell sets PYTHONDONTWRITEBYTECODE, so that test processes and
# pytest workers do not compile the project and rewrite the test files' assertions again each time
unexport PYTHONDONTWRITEBYTECODE
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: $(STAMP) test-sbn
	$(PY) -m pytest -q $(XDIST) --durations=25 tests

# The sync_batchnorm distribution (model/sync_batchnorm/pyproject.toml) as its users get it: its wheel in
# .venv-sbn, a venv that sees torch and pytest only (linked from $(VENV) by tests/linked_venv.py), and its own
# tests against the installed package (-P: nothing of the checkout on sys.path). setuptools builds in the
# source folder, so its build/ and egg-info are removed after.
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

# Every benchmark (each prints its table and writes JSON under benchmarks/results/), then one summary table of
# every target beside its A/A control. The allocator settings each runs with: benchmarks/README.md.
BENCHMARKS := bench_syncbn bench_model bench_data bench_eval bench_train bench_stop bench_optim bench_host_syncs bench_vs_plain bench_eval_vs_plain bench_runtimes bench_tracking bench_scene_predict
bench: $(STAMP)
	for name in $(BENCHMARKS); do $(PY) -m benchmarks.$$name || exit 1; done
	$(PY) -m benchmarks.summary

clean:
	rm -rf $(VENV) $(SBN_VENV) .pytest_cache model/sync_batchnorm/build model/sync_batchnorm/*.egg-info

# Train the CPU demo (synthetic shapes, configs/demo.yaml), then evaluate its best checkpoint (the per-class
# table). Runs in runs/demo/.
.PHONY: demo
demo: $(STAMP)
	$(PY) train.py --config demo.yaml --resume auto
	$(PY) eval.py --checkpoint runs/demo/best.pt
