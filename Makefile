# One virtualenv at .venv (git-ignored), created on first use and reinstalled only when the
# package metadata changes; every target runs XLA on the CPU unless PJRT_DEVICE says otherwise.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export PJRT_DEVICE ?= CPU

# the oldest supported combination (constraints/oldest.txt), installed fresh by `make test-matrix`
OLDEST ?= .venv-oldest
# a newer torch without torch_xla (constraints/no-xla.txt), installed fresh by `make test-no-xla`
NOXLA ?= .venv-no-xla

.PHONY: quickstart quickstart-fsdp2 test test-matrix test-no-xla venv-oldest venv-no-xla matrix-tests no-xla-tests \
	docs clean-venv

# setup.cfg declares ranges; CI installs the exact versions it was tested with (constraints/tested.txt)
$(STAMP): setup.cfg pyproject.toml constraints/tested.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,xla]' -c constraints/tested.txt
	@touch $(STAMP)

quickstart: $(STAMP)
	$(PY) examples/quickstart.py --output_dir runs/quickstart

# the same example on engine fsdp2 (torch's own FSDP2, no torch_xla used) in 2 processes, started as torchrun does
quickstart-fsdp2: $(STAMP)
	$(VENV)/bin/hf-xla-fsdp launch --num_processes 2 examples/quickstart.py --output_dir runs/quickstart-fsdp2 \
		--fsdp_config examples/fsdp2_config.json

# pytest-xdist workers, each taking whole files (module fixtures are built once). A test mostly runs one process that
# is single-threaded most of the time (Python, XLA's compiler) or waits on one: with 2 workers on the 2 cores about a
# quarter of the CPU stayed idle, and 3 fill it (measured 2026-11-29: pytest 1214 s with 2, 1112 s with 3; peak
# memory ~10 GB of 24)
WORKERS ?= 3

test: $(STAMP)
	$(PY) -m pytest -n $(WORKERS) --dist loadfile tests

# the fast tier (`-m "not slow"`, every test folder) on the oldest supported combination, in a venv made fresh each time:
# the runtime extras and the test tools only (the docs tools of [dev] need newer Jinja2 than the oldest supported).
# The benchmarks' smoke runs stay in `make test`: they guard the figure scripts, which are development tools, not a
# promise to users of the oldest versions (they were 5-6 of this leg's 11 minutes)
test-matrix:
	$(MAKE) venv-oldest
	$(MAKE) matrix-tests

# the package without torch_xla, on a newer torch (the CPU-only 2.13 build): it imports, and engine fsdp2 trains; the
# fast unit tier (tests that need torch_xla skip, with the reason: the `xla` marker, tests/conftest.py) and, in the
# same run, engine fsdp2's Trainer test (torchrun processes on the CPU, marked no_xla_leg); the other fsdp2 tests run
# in `make test`
test-no-xla:
	$(MAKE) venv-no-xla
	$(MAKE) no-xla-tests

# each leg in two parts, so that .ci/run can install both venvs while `make test` runs
venv-oldest:
	rm -rf $(OLDEST)
	python3 -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet -e '.[xla,finetune,examples,cloud]' pytest pytest-xdist wheel ruff \
		-c constraints/oldest.txt
	$(OLDEST)/bin/python -m pip check

matrix-tests:
	$(OLDEST)/bin/hf-xla-fsdp env --no-devices
	$(OLDEST)/bin/python -m pytest -n $(WORKERS) --dist loadfile -m "not slow" --ignore tests/e2e/test_benchmarks.py tests

venv-no-xla:
	rm -rf $(NOXLA)
	python3 -m venv $(NOXLA)
	$(NOXLA)/bin/python -m pip install --quiet -e '.[finetune]' pytest pytest-xdist -c constraints/no-xla.txt
	$(NOXLA)/bin/python -m pip check
	$(NOXLA)/bin/python -c "import importlib.util, sys; sys.exit('torch_xla is installed' if importlib.util.find_spec('torch_xla') else 0)"

no-xla-tests:
	$(NOXLA)/bin/hf-xla-fsdp env --no-devices
	$(NOXLA)/bin/python -m pytest -n $(WORKERS) --dist loadfile -m "not slow or no_xla_leg" tests/unit tests/e2e/test_fsdp2_trainer.py

# the documentation site (mkdocs.yml): strict, so a broken link or reference fails the build
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean-venv:
	rm -rf $(VENV) $(OLDEST) $(NOXLA)
