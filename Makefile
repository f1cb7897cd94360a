# One virtualenv at .venv (git-ignored), created on first use and reinstalled only when the
# package metadata changes; every target runs XLA on the CPU unless PJRT_DEVICE says otherwise.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export PJRT_DEVICE ?= CPU

.PHONY: quickstart test docs clean-venv

$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

quickstart: $(STAMP)
	$(PY) examples/quickstart.py --output_dir runs/quickstart

# two workers, each taking whole files (module fixtures are built once): the suite mostly waits on subprocesses'
# imports and compiles, which leave part of the 2 cores idle
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile tests

# the documentation site (mkdocs.yml): strict, so a broken link or reference fails the build
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean-venv:
	rm -rf $(VENV)
