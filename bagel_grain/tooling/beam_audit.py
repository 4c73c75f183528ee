"""`bagel-grain audit --runner R`: the audit's record pass as a Beam pipeline.

The launching process plans the tasks (`audit.plan`: runs of consecutive elements
of one group's epoch); workers run them (`audit.run_task`, the function the
in-process audit runs) with the config and tokenizer loaded once each; the
per-dataset audits merge on the runner (a CombineFn: merging is order-free) and
come back as one JSON file beside the report, which this process then writes.
A retried bundle recomputes its audits; the combine sees each task's result once.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import apache_beam as beam

from bagel_grain import fs
from bagel_grain.tooling import audit, beam_runner


def load(config: str | None, shipped: str, data: str):
  """The config as the command names it (`--config`, else the shipped one on `--data`)."""
  # pylint: disable=import-outside-toplevel
  from bagel_grain.config import load_config
  from bagel_grain.configs import load_shipped
  return load_config(config) if config else load_shipped(shipped, data)


class RunTasks(beam.DoFn):
  def __init__(self, where: tuple[str | None, str, str], seed: int | None):
    super().__init__()
    self._where, self._seed = where, seed
    self._epochs = None

  def setup(self) -> None:
    from bagel_grain.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
    cfg = load(*self._where)
    self._epochs = audit.GroupEpochs(cfg, load_tokenizer(cfg.tokenizer_path), self._seed)

  def process(self, task: audit.AuditTask):
    for key, found in audit.run_task(self._epochs, task):
      yield "/".join(key), found


class MergeAudits(beam.CombineFn):
  def create_accumulator(self) -> audit.Audit:
    return audit.Audit()

  def add_input(self, mutable_accumulator: audit.Audit, element: audit.Audit) -> audit.Audit:
    return mutable_accumulator.merge(element)

  def merge_accumulators(self, accumulators) -> audit.Audit:
    return audit.merge_all(accumulators)

  def extract_output(self, accumulator: audit.Audit) -> audit.Audit:
    return accumulator


def _write_states(keyed: list, path: str) -> None:
  fs.write_bytes(path, json.dumps({k: a.state() for k, a in sorted(keyed)}).encode())


def run_audit(where: tuple[str | None, str, str], out: str, runner: str,
              extra: Sequence[str] = (), *, sample: int | None = None, seed: int | None = None,
              task_elements: int = audit.DEFAULT_TASK_ELEMENTS) -> dict[str, Any]:
  """Audits on the runner; returns the report (written by the caller)."""
  cfg = load(*where)
  tasks = audit.plan(cfg, sample=sample, seed=seed, task_elements=task_elements)
  states = f"{out}.audits.json"
  with beam.Pipeline(options=beam_runner.pipeline_options(runner, extra)) as p:
    _ = (p
         | "tasks" >> beam.Create(tasks)
         | "spread" >> beam.Reshuffle()
         | "audit records" >> beam.ParDo(RunTasks(where, seed))
         | "merge per dataset" >> beam.CombinePerKey(MergeAudits())
         | "gather" >> beam.combiners.ToList()
         | "hand back" >> beam.Map(_write_states, states))
  merged = {tuple(k.split("/", 1)): audit.Audit.from_state(v)
            for k, v in json.loads(fs.read_bytes(states)).items()}
  fs.delete(states)
  return audit.build_report(cfg, merged, sample=sample, epoch_sizes=audit.epoch_sizes(cfg, seed))
