"""The audit's PNG (matplotlib is in the Beam venv, not the loader's): every panel has data,
a title and axis labels; drops by reason, the limits, zeros and the config are shown."""

from matplotlib import pyplot as plt
from matplotlib.patches import Rectangle

from bagel_grain.tooling import audit, audit_plot
from test_bad_data import corpus, corpus_config  # pylint: disable=unused-import


def _report(cfg, tokenizer):
  merged = audit.audit_in_process(cfg, tokenizer)
  return audit.build_report(cfg, merged, sample=None, epoch_sizes=audit.epoch_sizes(cfg))


def _legend(ax) -> str:
  legend = ax.get_legend()
  if legend is None:
    return ""
  return " ".join([t.get_text() for t in legend.get_texts()] + [legend.get_title().get_text()])


def test_every_panel_has_data_and_labels(corpus, demo_dir, demo_tokenizer, tmp_path):
  cfg = corpus_config(corpus, demo_dir)
  report = _report(cfg, demo_tokenizer)
  fig = audit_plot.figure(report, "bad.yaml")
  try:
    assert "bad.yaml" in fig.get_suptitle()
    names = list(report["groups"])
    axes = fig.axes
    assert len(axes) == 4 * (len(names) + 1)
    for ax in axes:
      assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel(), ax.get_title()
      assert ax.patches or ax.lines, f"{ax.get_title()}: no data drawn"
      if ax.get_xscale() == "log":  # readable: several labelled ticks, no bar below 1
        lo, hi = ax.get_xlim()
        fig.canvas.draw()
        shown = [t for t in ax.get_xticklabels()
                 if t.get_text() and lo <= t.get_position()[0] <= hi]
        assert len(shown) >= 2, ax.get_title()
        bars = [p for p in ax.patches if isinstance(p, Rectangle)]
        assert all(p.get_x() >= 1 for p in bars), ax.get_title()
    for row, name in enumerate(names, start=1):
      g = report["groups"][name]
      drops, packed, parts = axes[4 * row], axes[4 * row + 1], axes[4 * row + 2]
      labels = [t.get_text() for t in drops.get_yticklabels()]
      assert labels == ["packable", *g["drops"]]  # every reason, with its count
      assert [p.get_width() for p in drops.patches] == [
          g["packable"], *(d["count"] for d in g["drops"].values())]
      marks = {line.get_label().split()[0]: line.get_xdata()[0] for line in packed.lines}
      assert marks["max_num_tokens_per_sample"] == cfg.max_num_tokens_per_sample
      assert marks["max_num_tokens"] == cfg.max_num_tokens
      assert f"{g['over_max_tokens_per_sample']} dropped over it" in _legend(packed)
      vit = g["tokens_per_sample"]["vit"]
      if vit["count"] and vit["max"] == 0:  # T2I: no ViT tokens, said, not drawn at 10^-0.3
        assert f"ViT: all {vit['count']} are 0" in _legend(parts)
    assert report["groups"]["vlm_sft"]["over_max_tokens_per_sample"] > 0
    fill = axes[0]
    assert f"{report['run_estimate']['expected_fill']:.3f}" in [t.get_text() for t in fill.texts]
  finally:
    plt.close(fig)
  png = tmp_path / "audit.png"
  audit_plot.write_png(report, str(png), "bad.yaml")
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
