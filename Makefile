# The two entry points of the README: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Apache Beam's own venv: Beam caps pillow, pyarrow and protobuf below the loader's pins
# (constraints.txt), so `index/convert/audit --runner` and tests/beam run there.
BEAM_VENV := .venv-beam
BEAM_STAMP := $(BEAM_VENV)/.installed

.PHONY: demo test install beam-install bench clean

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

$(BEAM_STAMP): pyproject.toml constraints-beam.txt
	test -x $(BEAM_VENV)/bin/python || $(PYTHON) -m venv $(BEAM_VENV)
	$(BEAM_VENV)/bin/python -m pip install -q --upgrade pip
	$(BEAM_VENV)/bin/python -m pip install -q -c constraints-beam.txt -e '.[beam,test]'
	touch $(BEAM_STAMP)

install: $(STAMP)

beam-install: $(BEAM_STAMP)

.demo_data/.complete: $(STAMP)
	$(VENV)/bin/bagel-grain make-sample-data .demo_data

demo: .demo_data/.complete
	$(VENV)/bin/bagel-grain demo --data .demo_data
	@echo "--- the demo's video rows (an H.264 file and a frame folder), packed alone:"
	$(VENV)/bin/bagel-grain demo --config .demo_data/video_demo.yaml --batches 8

$(VENV)/.bench-installed: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[test,bench]'
	touch $@

.bench_data/.complete: $(VENV)/.bench-installed
	$(VENV)/bin/bagel-grain make-bench-data .bench_data

# Not part of CI: throughput against the decode+resize floor for 0, 1 and 2 workers.
bench: .bench_data/.complete
	$(VENV)/bin/bagel-grain bench --data .bench_data --workers 0 1 2 \
	  --seconds 40 --json out/bench.json --plot out/bench.png

# The main suite does not collect tests/beam (pyproject's pytest options); the Beam venv
# runs it after.
# `--dist loadscope` sends each module whole to one xdist worker, so a module-scoped
# fixture (an S3/GCS server, a multi-process training) is set up once. (`loadgroup`
# does nothing under pytest 9.2 with xdist 3.8: its group suffix never reaches the
# node id, so the tests of one module were spread over both workers.)
test: $(STAMP) $(BEAM_STAMP)
	$(PY) -m pytest -x -n auto --dist loadscope --durations=25 tests
	$(BEAM_VENV)/bin/python -m pytest -x -p no:cacheprovider tests/beam

clean:
	rm -rf $(VENV) $(BEAM_VENV) .demo_data .bench_data out
