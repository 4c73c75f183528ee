"""A worker process loads its code without JAX (about 150 MiB of resident memory each)."""

import os
import pickle
import subprocess
import sys
import textwrap
import time

from bagel_grain import pipeline
from bagel_grain.workers import Fetcher
from deadline import deadline
from slow_elements import ModulesLoaded


def _in_a_worker(group) -> list[int]:
  """What the first element a worker computed says (the main process computes the first
  ones itself while the worker starts)."""
  with deadline(120):
    fetcher = Fetcher([group], workers=1, depths=[2])
    try:
      for index in range(len(group)):
        pid, *flags = fetcher.get(0, index)
        if pid != os.getpid():
          return flags
        time.sleep(0.05)  # gives the worker time to start
    finally:
      fetcher.close()
  raise AssertionError("no element came from the worker")


def test_a_worker_loads_grain_and_our_code_without_jax():
  assert "jax" in sys.modules  # here (Grain imports it): the worker's is another story
  names = ("grain", "bagel_grain.workers.process", "jax", "jaxlib")
  assert _in_a_worker(ModulesLoaded(names)) == [1, 1, 0, 0]


def test_a_dataset_that_imports_jax_in_a_worker_gets_it():
  assert _in_a_worker(ModulesLoaded(("jax",), import_first="jax")) == [1]


def test_a_worker_loading_a_pipelines_datasets_imports_no_yaml(demo_config, demo_tokenizer,
                                                               tmp_path, monkeypatch):
  # Each worker's start-up is CPU: its imports and the datasets' unpickling (issue 32:
  # the workers come up after the main process decoded alone for 2 s). PyYAML is only for
  # reading configs: the families' option checks once pulled it in (~25 ms a worker).
  payload = tmp_path / "datasets.pickle"

  def recording(datasets, **kwargs):
    payload.write_bytes(pickle.dumps(list(datasets), protocol=pickle.HIGHEST_PROTOCOL))
    return Fetcher(datasets, **{**kwargs, "workers": 0})
  monkeypatch.setattr(pipeline, "Fetcher", recording)
  it = iter(pipeline.build_pipeline(demo_config, demo_tokenizer, batch_size=1, workers=2))
  it.close()
  worker = textwrap.dedent(f"""
      import pickle, sys
      from bagel_grain.workers import entry
      with entry.jax_unavailable():  # as entry.worker_main, then the datasets
        from bagel_grain.workers import process
      datasets = pickle.loads(open({str(payload)!r}, "rb").read())
      assert "bagel_grain.families.t2i" in sys.modules, sorted(sys.modules)
      print(sorted(m for m in ("yaml", "jax") if m in sys.modules))
      """)
  done = subprocess.run([sys.executable, "-c", worker], capture_output=True, text=True,
                        check=True, timeout=120)
  assert done.stdout.split("\n")[-2] == "[]", done.stdout
