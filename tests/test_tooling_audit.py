"""`bagel-grain audit`'s record pass: the loader's drops, by reason, on the same data."""

import collections
import dataclasses
import json
import sys

import pytest

from bagel_grain.pipeline import build_pipeline, pipeline_stats
from bagel_grain.tooling import audit
from test_bad_data import corpus, corpus_config, short_id  # pylint: disable=unused-import


def _loader_epoch(cfg, tokenizer):
  """One epoch of every group through the loader: its drop counts and its packed records."""
  it = iter(build_pipeline(dataclasses.replace(cfg, num_epochs=1), tokenizer, batch_size=2,
                           workers=0))
  try:
    packed = collections.Counter(k[0] for batch in it for keys in batch["sample_keys"]
                                 for k in keys)
    return pipeline_stats(it), packed
  finally:
    it.close()


def _report(cfg, tokenizer, **kwargs):
  merged = audit.audit_in_process(cfg, tokenizer, **kwargs)
  return audit.build_report(cfg, merged, sample=kwargs.get("sample"),
                            epoch_sizes=audit.epoch_sizes(cfg))


def test_the_bad_corpus_drops_are_the_injected_ones_and_the_loaders(corpus, demo_dir,
                                                                      demo_tokenizer):
  cfg = corpus_config(corpus, demo_dir)
  report = _report(cfg, demo_tokenizer)
  stats, packed = _loader_epoch(cfg, demo_tokenizer)
  for group, expected in corpus.expected_drops.items():
    g = report["groups"][group]
    found = {reason: d["count"] for reason, d in g["drops"].items()}
    assert found == dict(expected) == dict(stats["drops"][group]), group
    assert g["records"] == stats["counts"][group]["drawn"] == g["records_per_epoch"]
    assert g["packable"] == packed[group]
    for reason, d in g["drops"].items():  # examples: bad records, smallest ids first
      assert len(d["examples"]) == min(5, d["count"]) and d["examples"] == sorted(d["examples"])
      assert {short_id(r) for r in d["examples"]} <= corpus.bad[group]
  assert report["groups"]["vlm_sft"]["over_max_tokens_per_sample"] == \
      corpus.expected_drops["vlm_sft"]["over_max_tokens_per_sample"] > 0


def test_the_demo_audit_counts_every_record_and_its_tokens(demo_config, demo_tokenizer):
  report = _report(demo_config, demo_tokenizer)
  stats, packed = _loader_epoch(demo_config, demo_tokenizer)
  for name, g in report["groups"].items():
    assert g["dropped"] == sum(stats["drops"][name].values())
    assert g["packable"] == packed[name] == g["tokens_per_sample"]["packed"]["count"]
    text = g["tokens_per_sample"]["text"]
    assert text["exact_quantiles"] and text["min"] <= text["quantiles"]["p50"] <= text["max"]
  t2i = report["groups"]["t2i_pretrain"]
  assert t2i["tokens_per_sample"]["vit"]["max"] == 0 < t2i["tokens_per_sample"]["vae"]["min"]
  # Every T2I image is one VAE image: as many resized as sampled, none larger than before.
  sizes = t2i["image_sizes"]
  assert sizes["width_before"]["count"] == sizes["width_after"]["count"] == t2i["packable"]
  run = report["run_estimate"]
  assert 0 < run["expected_fill"] <= 1
  assert max(g["epochs_when_the_longest_ends"] for g in run["groups"].values()) >= 1
  assert min(g["epochs_when_the_longest_ends"] for g in run["groups"].values()) == 1


def test_a_sample_audits_the_first_records_of_each_epoch(demo_config, demo_tokenizer):
  report = _report(demo_config, demo_tokenizer, sample=7)
  assert all(g["records"] == 7 for g in report["groups"].values())
  assert "sample of 7" in audit.summary(report)


@pytest.mark.parametrize("values", [[3.0] * 10, list(range(1, 400)), [0, 0, 5, 1e6]])
def test_distributions_merge_in_any_order_and_bin_quantiles_stay_close(values, monkeypatch):
  parts = [audit.Distribution() for _ in range(3)]
  for i, v in enumerate(values):
    parts[i % 3].add(v)
  a, b = audit.Distribution(), audit.Distribution()
  for p in parts:
    a.merge(p)
  for p in reversed(parts):
    b.merge(p)
  assert a.report() == b.report()
  monkeypatch.setattr(audit, "EXACT_VALUES", 1)
  binned = audit.Distribution()
  for v in values:
    binned.add(v)
  assert binned.values is None
  for q in audit.QUANTILES:
    exact = a.quantile(q)
    assert abs(binned.quantile(q) - exact) <= 0.1 * exact + 1


def test_without_matplotlib_the_audit_prints_and_writes_its_json(demo_dir, tmp_path,
                                                                  monkeypatch, capsys):
  from bagel_grain.tooling import audit_plot, cli
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # as in the loader's venv
  out = tmp_path / "audit"
  assert cli.main(["audit", "--data", str(demo_dir), "--out", str(out), "--sample", "4"]) == 0
  printed = capsys.readouterr().out.splitlines()
  assert printed[0] == "audit of a sample of 4 records per group"
  assert audit_plot.HOW_TO_GET_IT in printed and "matplotlib" in audit_plot.HOW_TO_GET_IT
  report = json.loads((out.parent / "audit.json").read_text())
  assert all(g["records"] == 4 for g in report["groups"].values())
  assert not (out.parent / "audit.png").exists()
