"""`bagel-grain audit`: what a corpus holds, before a pod is spent on it.

Every record of every group goes through the family transform and the sample
layout exactly as the loader's epoch 0 has them (one process, no logical
shards: the same record order, the same per-record random choices), then
through the packer's drop policy (`max_num_tokens_per_sample`, the row
capacities), without packing. Per group and dataset the audit counts records and
drops by reason (the 5 first record ids of each, by id), and collects the tokens
per sample (text, ViT, VAE, upstream's packed size) and the image sizes before and
after resizing. From those and the config's weights it estimates a run: rows per
epoch of each group, fill, epochs of each group.

The work splits into tasks of consecutive elements of one group (`AuditTask`);
each task's result is an `Audit`, and audits merge in any order into the same
report, so the Beam pipeline (`beam_audit.py`) and this process agree. `sample`
audits only the first N elements of each group's epoch: a uniform random sample,
as the epoch order is a shuffle.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import math
from typing import Any, Iterable

import grain
import numpy as np
from PIL import Image

from bagel_grain import fs
from bagel_grain.packing.drop_policy import DropPolicy
from bagel_grain.packing.layout import Geometry
from bagel_grain.packing.prepare import PrepareSample, PreparedSample
from bagel_grain.pipeline import (capacities, family_seed, family_transform, group_records,
                                  stream_seeds)
from bagel_grain.sources.records import Record

EXAMPLES = 5  # record ids kept per drop reason
EXACT_VALUES = 100_000  # values a distribution keeps for exact quantiles; past that, its bins
BINS_PER_OCTAVE = 8  # histogram bins: a quantile read from them is within 9% of the value
QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
DEFAULT_TASK_ELEMENTS = 256
TOKEN_KINDS = ("text", "vit", "vae", "packed")
HEADER_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")  # sizes read from the header
IMAGE_KINDS = ("width_before", "height_before", "width_after", "height_after")


# --- mergeable summaries ------------------------------------------------------------


def _bin(value: float) -> int:
  """Histogram bin of a value >= 0: 0 holds [0, 1), bin k >= 1 holds [2^((k-1)/B), 2^(k/B))."""
  return 0 if value < 1 else 1 + int(math.floor(math.log2(value) * BINS_PER_OCTAVE))


def _bin_edges(k: int) -> tuple[float, float]:
  return (0.0, 1.0) if k == 0 else (2 ** ((k - 1) / BINS_PER_OCTAVE), 2 ** (k / BINS_PER_OCTAVE))


@dataclasses.dataclass
class Distribution:
  """Counts of non-negative values: exact while few, then log-spaced bins; merges in any order."""

  count: int = 0
  total: float = 0.0
  low: float = math.inf
  high: float = 0.0
  bins: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  values: list | None = dataclasses.field(default_factory=list)  # None once over EXACT_VALUES

  def add(self, value: float) -> None:
    self.count += 1
    self.total += value
    self.low, self.high = min(self.low, value), max(self.high, value)
    self.bins[_bin(value)] += 1
    if self.values is not None:
      self.values.append(value)
      if len(self.values) > EXACT_VALUES:
        self.values = None

  def merge(self, other: Distribution) -> None:
    self.count += other.count
    self.total += other.total
    self.low, self.high = min(self.low, other.low), max(self.high, other.high)
    self.bins.update(other.bins)
    if self.values is None or other.values is None or (
        len(self.values) + len(other.values) > EXACT_VALUES):
      self.values = None
    else:
      self.values.extend(other.values)

  def quantile(self, q: float) -> float:
    if self.values is not None:
      return float(np.quantile(np.sort(self.values), q, method="inverted_cdf"))
    rank, seen = q * self.count, 0
    for k in sorted(self.bins):
      if seen + self.bins[k] >= rank:
        lo, hi = _bin_edges(k)
        return float(min(self.high, max(self.low, lo + (hi - lo) * (rank - seen) / self.bins[k])))
      seen += self.bins[k]
    return float(self.high)

  def histogram(self) -> dict[str, list]:
    """Bin edges (lower, upper) and counts of the non-empty range of bins."""
    if not self.bins:
      return {"lower": [], "upper": [], "counts": []}
    ks = range(min(self.bins), max(self.bins) + 1)
    return {"lower": [_bin_edges(k)[0] for k in ks], "upper": [_bin_edges(k)[1] for k in ks],
            "counts": [self.bins.get(k, 0) for k in ks]}

  def state(self) -> dict[str, Any]:
    """Plain JSON (what a pipeline hands back), read by `from_state`."""
    return {"count": self.count, "total": self.total, "low": self.low if self.count else None,
            "high": self.high, "bins": {str(k): n for k, n in self.bins.items()},
            "values": self.values}

  @classmethod
  def from_state(cls, state: dict[str, Any]) -> Distribution:
    return cls(state["count"], state["total"],
               math.inf if state["low"] is None else state["low"], state["high"],
               collections.Counter({int(k): n for k, n in state["bins"].items()}),
               state["values"])

  def report(self) -> dict[str, Any]:
    if not self.count:
      return {"count": 0}
    return {"count": self.count, "mean": self.total / self.count, "min": self.low,
            "max": self.high, "exact_quantiles": self.values is not None,
            "quantiles": {f"p{round(q * 100)}": self.quantile(q) for q in QUANTILES},
            "histogram": self.histogram()}


@dataclasses.dataclass
class Audit:
  """What the audit found in one group's dataset (or in any merge of such)."""

  records: int = 0
  packable: int = 0
  drops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  examples: dict = dataclasses.field(default_factory=dict)  # reason -> smallest record ids
  tokens: dict = dataclasses.field(
      default_factory=lambda: {k: Distribution() for k in TOKEN_KINDS})
  images: dict = dataclasses.field(
      default_factory=lambda: {k: Distribution() for k in IMAGE_KINDS})

  def drop(self, reason: str, record: str) -> None:
    self.drops[reason] += 1
    self.examples[reason] = sorted([*self.examples.get(reason, []), record])[:EXAMPLES]

  def merge(self, other: Audit) -> Audit:
    self.records += other.records
    self.packable += other.packable
    self.drops.update(other.drops)
    for reason, ids in other.examples.items():
      self.examples[reason] = sorted([*self.examples.get(reason, []), *ids])[:EXAMPLES]
    for mine, theirs in ((self.tokens, other.tokens), (self.images, other.images)):
      for kind, dist in theirs.items():
        mine[kind].merge(dist)
    return self

  def state(self) -> dict[str, Any]:
    return {"records": self.records, "packable": self.packable, "drops": dict(self.drops),
            "examples": self.examples,
            "tokens": {k: d.state() for k, d in self.tokens.items()},
            "images": {k: d.state() for k, d in self.images.items()}}

  @classmethod
  def from_state(cls, state: dict[str, Any]) -> Audit:
    return cls(state["records"], state["packable"], collections.Counter(state["drops"]),
               state["examples"],
               {k: Distribution.from_state(d) for k, d in state["tokens"].items()},
               {k: Distribution.from_state(d) for k, d in state["images"].items()})

  def report(self) -> dict[str, Any]:
    return {"records": self.records, "packable": self.packable,
            "dropped": sum(self.drops.values()),
            "drops": {r: {"count": n, "examples": self.examples[r]}
                      for r, n in sorted(self.drops.items())},
            "tokens_per_sample": {k: d.report() for k, d in self.tokens.items()},
            "image_sizes": {k: d.report() for k, d in self.images.items()}}


def merge_all(audits: Iterable[Audit]) -> Audit:
  total = Audit()
  for a in audits:
    total.merge(a)
  return total


# --- the work ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AuditTask:
  """Elements [start, stop) of a group's epoch 0."""

  group: int
  start: int
  stop: int


def plan(cfg, *, sample: int | None = None, seed: int | None = None,
         task_elements: int = DEFAULT_TASK_ELEMENTS) -> list[AuditTask]:
  """The tasks covering every group's epoch (its first `sample` elements with `sample`)."""
  order_seed, _ = stream_seeds(cfg, seed)
  tasks = []
  for g in range(len(cfg.groups)):
    n = group_records(cfg, g, seed=order_seed).records_per_epoch
    n = n if sample is None else min(n, sample)
    tasks += [AuditTask(g, a, min(a + task_elements, n)) for a in range(0, n, task_elements)]
  return tasks


class _Observed(grain.transforms.RandomMap):
  """The family transform, noting each record's dataset and the images it decodes."""

  def __init__(self, family):
    self.family = family
    self.dataset: dict[int, int] = {}
    self.images: dict[int, list] = collections.defaultdict(list)
    self._current = None
    load = family.load

    def observed_load(data, targets):
      resized = load(data, targets)
      try:
        # The header only, and only formats that decode nothing while opening.
        with Image.open(io.BytesIO(bytes(data)), formats=HEADER_FORMATS) as img:
          before = img.size
      except Exception:  # pylint: disable=broad-except  # decoded already: cannot fail here
        before = None
      self.images[self._current].extend((before, (a.shape[1], a.shape[0])) for a in resized)
      return resized

    # The loader's own transform, with its image loading observed (an instance attribute).
    family.load = observed_load

  def random_map(self, element: Record, rng: np.random.Generator):
    self._current = element.index
    self.dataset[element.index] = element.dataset
    return self.family.random_map(element, rng)


def _elements(cfg, group: int, tokenizer, seed: int | None):
  """The group's epoch as the loader's one process sees it: element i is (record, family
  transform, layout) with the loader's seeds (`pipeline.prepared_samples`, without its
  read-ahead, which only moves reads earlier)."""
  order_seed, sample_seed = stream_seeds(cfg, seed)
  records = group_records(cfg, group, seed=order_seed)
  observed = _Observed(family_transform(cfg, group, tokenizer))
  geometry = Geometry(cfg.vit_patch_size, cfg.vae_image_downsample, cfg.max_num_patch_per_side,
                      cfg.max_latent_size, cfg.interpolate_pos)
  prepare = PrepareSample(sample_seed, geometry, tokenizer.special, cfg.text_cond_dropout_prob,
                          cfg.vit_cond_dropout_prob, cfg.vae_cond_dropout_prob)
  return records.random_map(observed, seed=family_seed(sample_seed, group, 0)).map(prepare), \
      observed


def drop_policy(cfg) -> DropPolicy:
  return DropPolicy(max_num_tokens_per_sample=cfg.max_num_tokens_per_sample,
                    capacities=capacities(cfg), max_consecutive_drops=cfg.max_consecutive_drops)


class GroupEpochs:
  """Each group's epoch (`_elements`), built once per process and reused by its tasks: a
  group's record index (16 bytes a JSONL line, about 64 per row group) is loaded once."""

  def __init__(self, cfg, tokenizer, seed: int | None = None):
    self.cfg, self.tokenizer, self.seed = cfg, tokenizer, seed
    self._built: dict[int, tuple] = {}

  def __getitem__(self, group: int):
    if group not in self._built:
      self._built[group] = _elements(self.cfg, group, self.tokenizer, self.seed)
    return self._built[group]


def run_task(epochs: GroupEpochs, task: AuditTask) -> list[tuple[tuple[str, str], Audit]]:
  """The task's elements audited: ((group, dataset), Audit) per dataset met."""
  g = epochs.cfg.groups[task.group]
  elements, observed = epochs[task.group]
  policy = drop_policy(epochs.cfg)
  audits: dict[str, Audit] = {}
  for i in range(task.start, task.stop):
    element = elements[i]
    dataset = g.datasets[observed.dataset.pop(i)].name
    audit = audits.setdefault(dataset, Audit())
    audit.records += 1
    reason = policy.reason(element)
    record = element.key.record if element.key is not None else f"element {i}"
    if reason is not None:
      audit.drop(str(reason), record)
    else:
      audit.packable += 1
      _count_tokens(audit, element)
    for before, after in observed.images.pop(i, []):
      if before is not None:
        audit.images["width_before"].add(before[0])
        audit.images["height_before"].add(before[1])
      audit.images["width_after"].add(after[0])
      audit.images["height_after"].add(after[1])
  return [((g.name, name), a) for name, a in audits.items()]


def _count_tokens(audit: Audit, element: PreparedSample) -> None:
  layout = element.layout
  audit.tokens["text"].add(int((layout.token_type == 1).sum()))
  audit.tokens["vit"].add(int(layout.num_vit_tokens))
  audit.tokens["vae"].add(int(layout.num_vae_tokens))
  audit.tokens["packed"].add(int(element.packed_size))


def audit_in_process(cfg, tokenizer, *, sample: int | None = None,
                     seed: int | None = None) -> dict[tuple[str, str], Audit]:
  """Every task run here, merged per (group, dataset)."""
  merged: dict[tuple[str, str], Audit] = {}
  epochs = GroupEpochs(cfg, tokenizer, seed)
  for task in plan(cfg, sample=sample, seed=seed):
    for key, audit in run_task(epochs, task):
      merged.setdefault(key, Audit()).merge(audit)
  return merged


# --- the report -----------------------------------------------------------------------


def estimate_run(cfg, groups: dict[str, Audit], sampled: dict[str, float]) -> dict[str, Any]:
  """What a run at the configured budget will look like, from the audited samples.

  Model: the mixer draws group g with probability w_g (its weight share) and the
  packer closes a row once it holds `expected_num_tokens` (never past
  `max_num_tokens`); a row's real tokens are about `expected_num_tokens` plus half a
  sample (the greedy packer's mean overshoot). With s the weight-averaged packed size
  and n = tokens per row / s samples per row, group g takes n w_g samples a row: its
  epoch of P_g packable samples lasts P_g / (n w_g) rows. `sampled[g]` scales a
  sampled audit up to the group's whole epoch.
  """
  weights = {g.name: g.weight for g in cfg.groups}
  total_w = sum(weights.values())
  share = {name: w / total_w for name, w in weights.items()}
  mean_size = {name: a.tokens["packed"].total / a.tokens["packed"].count
               for name, a in groups.items() if a.tokens["packed"].count}
  if not mean_size:
    return {"note": "no packable sample: nothing to estimate"}
  covered = sum(share[n] for n in mean_size)
  s = sum(share[n] * mean_size[n] for n in mean_size) / covered
  row_tokens = min(cfg.max_num_tokens, cfg.expected_num_tokens + s / 2)
  per_row = row_tokens / s
  rows = {n: groups[n].packable * sampled[n] / (per_row * share[n])
          for n in mean_size if share[n] > 0}
  longest = max(rows.values())
  return {
      "model": "greedy packing to expected_num_tokens; groups drawn by weight share",
      "expected_num_tokens": cfg.expected_num_tokens, "max_num_tokens": cfg.max_num_tokens,
      "mean_packed_size": s, "samples_per_row": per_row,
      "expected_fill": row_tokens / cfg.max_num_tokens,
      "groups": {n: {"weight_share": share[n], "packable_per_epoch": groups[n].packable *
                     sampled[n], "rows_per_epoch": rows[n], "epochs_when_the_longest_ends":
                     longest / rows[n]} for n in rows},
      "rows_until_every_group_did_one_epoch": longest,
  }


def build_report(cfg, merged: dict[tuple[str, str], Audit], *, sample: int | None,
                 epoch_sizes: dict[str, int]) -> dict[str, Any]:
  """The JSON report: per group (and its datasets), then the run estimate."""
  groups: dict[str, Audit] = {}
  for (group, _), audit in sorted(merged.items()):
    groups.setdefault(group, Audit()).merge(audit)
  sampled = {name: epoch_sizes[name] / max(1, a.records) for name, a in groups.items()}
  return {
      "sample": sample, "max_num_tokens_per_sample": cfg.max_num_tokens_per_sample,
      "groups": {name: {**a.report(), "records_per_epoch": epoch_sizes[name],
                        "over_max_tokens_per_sample": a.drops.get(
                            "over_max_tokens_per_sample", 0),
                        "datasets": {d: merged[(name, d)].report()
                                     for (g, d) in sorted(merged) if g == name}}
                 for name, a in groups.items()},
      "run_estimate": estimate_run(cfg, groups, sampled),
  }


def epoch_sizes(cfg, seed: int | None = None) -> dict[str, int]:
  order_seed, _ = stream_seeds(cfg, seed)
  return {g.name: group_records(cfg, i, seed=order_seed).records_per_epoch
          for i, g in enumerate(cfg.groups)}


def summary(report: dict[str, Any]) -> str:
  """A few lines for stdout."""
  lines = [f"audit of {'a sample of ' + str(report['sample']) + ' records per group' if report['sample'] else 'every record'}"]
  lines.append(f"{'group':16s} {'records':>8s} {'packable':>8s} {'dropped':>8s}  "
               f"{'text p50':>8s} {'ViT p50':>8s} {'VAE p50':>8s} {'packed p99':>10s}")
  for name, g in report["groups"].items():
    t = g["tokens_per_sample"]

    def q(kind, p, t=t):
      return f"{t[kind]['quantiles'][p]:.0f}" if t[kind]["count"] else "-"
    lines.append(f"{name:16s} {g['records']:8d} {g['packable']:8d} {g['dropped']:8d}  "
                 f"{q('text', 'p50'):>8s} {q('vit', 'p50'):>8s} {q('vae', 'p50'):>8s} "
                 f"{q('packed', 'p99'):>10s}")
    for reason, d in g["drops"].items():
      lines.append(f"  {reason}: {d['count']} (e.g. {d['examples'][0]})")
  run = report["run_estimate"]
  if "groups" in run:
    lines.append(f"run: fill {run['expected_fill']:.3f}, {run['samples_per_row']:.2f} samples "
                 f"per row; rows until every group did one epoch: "
                 f"{run['rows_until_every_group_did_one_epoch']:,.0f}")
    lines.append("  " + ", ".join(f"{n}: {g['rows_per_epoch']:,.0f} rows/epoch, "
                                  f"{g['epochs_when_the_longest_ends']:.2f} epochs"
                                  for n, g in run["groups"].items()))
  return "\n".join(lines)


def write_report(report: dict[str, Any], out: str,
                 config_name: str = "the config") -> tuple[str, str | None]:
  """Writes `OUT.json` and, when matplotlib is there, `OUT.png` (`audit_plot`); OUT may be a
  bucket URI. Returns their paths, None for a PNG not drawn."""
  import json  # pylint: disable=import-outside-toplevel
  from bagel_grain.tooling import audit_plot  # pylint: disable=import-outside-toplevel
  json_path, png_path = f"{out}.json", f"{out}.png"
  fs.write_bytes(json_path, json.dumps(report, indent=1).encode())
  try:
    audit_plot.write_png(report, png_path, config_name)
  except audit_plot.PlotUnavailable:
    return json_path, None
  return json_path, png_path
