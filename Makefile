# The two entry points of the README: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

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

test: $(STAMP)
	$(PY) -m pytest -x -n auto tests

clean:
	rm -rf $(VENV) .demo_data .bench_data out
