# transformers-mst. `make help` lists the targets.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
MST := PYTHONPATH=scripts $(PY) -m mstbuild
WHEEL_DIR := dist
# Where `make demo` / `make bench` write: out/ is ignored by git, so a run leaves the checkout
# clean. OUT=docs replaces the committed docs/demo.png and docs/bench/ on purpose.
OUT ?= out

.PHONY: help venv wheel install test demo bench workspace patches rebase clean distclean

help:
	@echo "make test        bootstrap .venv, build + install the distribution, run the test suite"
	@echo "make demo        bootstrap, build + install, run the demo (a short training run); plot in out/demo.png"
	@echo "make bench       bootstrap, build + install, run the benchmarks (SWEEPS=\"methods blocks families host\"); results in out/bench/"
	@echo "                 OUT=docs: write into the committed docs/demo.png, docs/bench/ instead (on purpose)"
	@echo "make wheel       build dist/transformers-<version>+mst.N-py3-none-any.whl"
	@echo "make workspace   work/pristine (upstream) + work/patched (git stack of our patches); FORCE=1 discards work/"
	@echo "make patches     regenerate patches/*.patch and patches/series from work/patched"
	@echo "make rebase UPSTREAM=X.Y.Z SHA256=<wheel sha256>   the series on another upstream release, in work/;"
	@echo "                 if all apply: regenerate patches + pin, build, scratch venv, tests (TESTS=..., NOTEST=1,"
	@echo "                 FORCE=1 discards work/); one report. Rejects: work/rejects/, see docs/rebase.md"
	@echo "make clean       remove build outputs and work/;  make distclean  also .venv and .cache"

venv: $(VENV)/.ready
$(VENV)/.ready: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -r requirements-dev.txt
	touch $@

# Built without build isolation from the venv (it has `wheel`); the upstream wheel is
# downloaded once into .cache/ and verified. `pip install .` works too (see README).
wheel: venv
	rm -rf $(WHEEL_DIR)
	MST_UPSTREAM_WHEEL="$$($(MST) fetch)" $(PIP) wheel --quiet --no-deps --no-build-isolation -w $(WHEEL_DIR) .

install: wheel
	$(PIP) install --quiet --force-reinstall --no-deps $(WHEEL_DIR)/transformers-*.whl
	$(PIP) install --quiet $(WHEEL_DIR)/transformers-*.whl -r requirements-test.txt

# The test files spread over one worker process per core (pytest-xdist; a file's tests stay on one worker, so its
# module fixtures run once), each with one intra-op thread: with two, a process's threads spin while the other process
# holds the cores (README, "Set up and test"). TEST_WORKERS=0: one process, still on one thread.
TEST_WORKERS ?= auto
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile tests

demo: install
	$(PY) scripts/demo.py --plot $(OUT)/demo.png $(ARGS)

# SWEEPS: any of methods blocks families host streaming mamba (scripts/bench.py --help); results go to $(OUT)/bench/.
bench: install
	for sweep in $(or $(SWEEPS),methods blocks families host); do $(PY) scripts/bench.py $$sweep --out $(OUT)/bench $(ARGS) || exit 1; done

workspace: venv
	$(MST) workspace $(if $(FORCE),--force)

patches: venv
	$(MST) patches

rebase: venv
	@test -n "$(UPSTREAM)" -a -n "$(SHA256)" || { echo "usage: make rebase UPSTREAM=X.Y.Z SHA256=<sha256 of transformers-X.Y.Z-py3-none-any.whl>"; exit 2; }
	$(MST) rebase --upstream $(UPSTREAM) --sha256 $(SHA256) $(if $(FORCE),--force) $(if $(NOTEST),--no-test) $(if $(TESTS),--pytest-args "$(TESTS)")

clean:
	rm -rf $(WHEEL_DIR) build work .pytest_cache
	find . -name __pycache__ -not -path "./$(VENV)/*" -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) .cache
