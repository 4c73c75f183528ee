"""The audit's PNG: what a person decides from before a pod run, drawn from the report.

One row for the run (predicted fill, each group's share of samples, rows per epoch and
epochs while the longest group does one), then one row per group: records kept and
dropped by reason, packed tokens per sample against the limits (`max_num_tokens_per_sample`
and the row's budget), text / ViT / VAE tokens per sample, image widths before and after
resizing. Token and width axes are logarithmic; zeros cannot sit on them, so they are
counted in the legend instead of drawn below 10^0. matplotlib is optional: without it the
audit writes its JSON and says how to get the picture (`PlotUnavailable`).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from bagel_grain import fs

HOW_TO_GET_IT = ("no PNG: the audit's plot needs matplotlib (`pip install -c constraints.txt "
                 "matplotlib` in this venv, or run the audit from .venv-beam)")
_KINDS = (("text", "text", "tab:green"), ("vit", "ViT", "tab:orange"), ("vae", "VAE", "tab:purple"))


class PlotUnavailable(ImportError):
  """matplotlib is not installed: the report has no picture (its message says how to get one)."""


def _pyplot():
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise PlotUnavailable(HOW_TO_GET_IT) from None
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=import-outside-toplevel
  return pyplot


def write_png(report: dict[str, Any], path: str, config_name: str) -> None:
  """Draws the report (`figure`) to `path` (a bucket URI too). PlotUnavailable without
  matplotlib."""
  plt = _pyplot()
  fig = figure(report, config_name)
  out = io.BytesIO()
  fig.savefig(out, format="png", dpi=72)
  plt.close(fig)
  fs.write_bytes(path, out.getvalue())


def figure(report: dict[str, Any], config_name: str):
  """The matplotlib figure of the report; every panel has a title, axis labels and data."""
  plt = _pyplot()
  names = list(report["groups"])
  fig, axes = plt.subplots(len(names) + 1, 4, figsize=(20, 3.6 * (len(names) + 1)),
                           squeeze=False)
  _run_row(axes[0], report)
  for row, name in zip(axes[1:], names):
    group = report["groups"][name]
    _drops(row[0], name, group)
    _packed(row[1], name, group, report)
    _parts(row[2], name, group)
    _widths(row[3], name, group)
  what = (f"a sample of {report['sample']} records per group" if report["sample"]
          else "every record")
  fig.suptitle(f"bagel-grain audit of {config_name} ({what})", fontsize=14)
  fig.tight_layout(rect=(0, 0, 1, 0.98))
  return fig


# --- the run -------------------------------------------------------------------------


def _run_row(row, report: dict[str, Any]) -> None:
  run = report["run_estimate"]
  groups = run.get("groups", {})
  names = list(groups) or list(report["groups"])
  ax = row[0]
  fill = run.get("expected_fill", 0.0)
  ax.barh(["fill"], [fill], color="tab:blue")
  ax.barh(["fill"], [1 - fill], left=[fill], color="lightgray")
  ax.set_xlim(0, 1)
  ax.text(fill / 2, 0, f"{fill:.3f}", ha="center", va="center", color="white", fontsize=12)
  ax.set_title(f"predicted fill of a row: {run.get('samples_per_row', 0):.1f} samples, "
               f"budget {run.get('max_num_tokens', '-')} tokens")
  ax.set_xlabel("share of max_num_tokens holding tokens")
  ax.set_ylabel("row")
  for ax, key, title, label in (
      (row[1], "weight_share", "share of samples (weights)", "share"),
      (row[2], "rows_per_epoch", "rows one epoch of the group fills", "rows"),
      (row[3], "epochs_when_the_longest_ends", "epochs while the longest group does one",
       "epochs")):
    values = [groups.get(n, {}).get(key, 0.0) for n in names]
    bars = ax.bar(names, values, color="tab:blue")
    ax.bar_label(bars, fmt="%.2f" if key != "rows_per_epoch" else "%.0f", fontsize=9)
    ax.set_title(f"run: {title}")
    ax.set_xlabel("group")
    ax.set_ylabel(label)
    ax.tick_params(axis="x", labelsize=9)


# --- one group -----------------------------------------------------------------------


def _drops(ax, name: str, group: dict[str, Any]) -> None:
  reasons = list(group["drops"])
  labels = ["packable"] + reasons
  counts = [group["packable"]] + [group["drops"][r]["count"] for r in reasons]
  bars = ax.barh(labels, counts, color=["tab:green"] + ["tab:red"] * len(reasons))
  ax.bar_label(bars, fontsize=9)
  ax.invert_yaxis()
  ax.set_xlim(0, max(counts + [1]) * 1.25)
  ax.set_title(f"{name}: {group['records']} records, {group['dropped']} dropped")
  ax.set_xlabel("records")
  ax.set_ylabel("kept, or dropped by reason")
  ax.tick_params(axis="y", labelsize=8)


def _packed(ax, name: str, group: dict[str, Any], report: dict[str, Any]) -> None:
  run = report["run_estimate"]
  limits = [(report["max_num_tokens_per_sample"], "max_num_tokens_per_sample", "tab:red"),
            (run.get("expected_num_tokens"), "expected_num_tokens", "tab:gray"),
            (run.get("max_num_tokens"), "max_num_tokens", "black")]
  dist = group["tokens_per_sample"]["packed"]
  zeros = _hist(ax, dist, "packable samples", "tab:blue")
  over = group.get("over_max_tokens_per_sample", 0)
  for value, label, colour in limits:
    if value:
      extra = f", {over} dropped over it" if label == "max_num_tokens_per_sample" else ""
      ax.axvline(value, color=colour, linestyle="--", label=f"{label} {value}{extra}")
  _log_axis(ax, dist, [v for v, _, _ in limits if v])
  ax.legend(fontsize=7, loc="best", title=_zeros(zeros), title_fontsize=7)
  ax.set_title(f"{name}: packed tokens per sample")
  ax.set_xlabel("tokens per sample (log scale)")
  ax.set_ylabel("samples")


def _parts(ax, name: str, group: dict[str, Any]) -> None:
  tokens = group["tokens_per_sample"]
  for kind, label, colour in _KINDS:
    dist = tokens[kind]
    count = dist.get("count", 0)
    zeros = _hist(ax, dist, label, colour, step=True)
    if count and zeros == count:
      ax.plot([], [], color=colour, label=f"{label}: all {count} are 0")
  if not tokens["packed"].get("count"):
    ax.text(0.5, 0.5, "no packable sample", ha="center", va="center", transform=ax.transAxes)
  else:
    _log_axis(ax, *[tokens[k] for k, _, _ in _KINDS])
    ax.legend(fontsize=8)
  ax.set_title(f"{name}: text, ViT and VAE tokens per sample")
  ax.set_xlabel("tokens (log scale)")
  ax.set_ylabel("samples")


def _widths(ax, name: str, group: dict[str, Any]) -> None:
  sizes = group["image_sizes"]
  for kind, colour in (("width_before", "tab:gray"), ("width_after", "tab:blue")):
    _hist(ax, sizes[kind], kind.replace("_", " "), colour, step=kind == "width_after")
  if not sizes["width_after"].get("count"):
    ax.text(0.5, 0.5, "no images", ha="center", va="center", transform=ax.transAxes)
  else:
    _log_axis(ax, sizes["width_before"], sizes["width_after"])
    ax.legend(fontsize=8)
  ax.set_title(f"{name}: image width before and after resizing")
  ax.set_xlabel("width (pixels, log scale)")
  ax.set_ylabel("images")


# --- histograms on log axes ----------------------------------------------------------


def _hist(ax, dist: dict[str, Any], label: str, colour: str, step: bool = False) -> int:
  """Draws the report's log-binned histogram but its [0, 1) bin (zeros on a count of
  tokens or pixels), whose count it returns for the legend."""
  if not dist.get("count"):
    return 0
  h = dist["histogram"]
  lower, upper, counts = (np.asarray(h[k], float) for k in ("lower", "upper", "counts"))
  zeros = int(counts[lower < 1].sum())
  keep = lower >= 1
  if keep.any():
    shown = f"{label} ({zeros} at 0)" if zeros else label
    if step:
      edges = np.append(lower[keep], upper[keep][-1])
      ax.stairs(counts[keep], edges, color=colour, label=shown, linewidth=1.5)
    else:
      ax.bar(lower[keep], counts[keep], width=upper[keep] - lower[keep], align="edge",
             color=colour, alpha=0.6, label=shown)
  return zeros


def _zeros(zeros: int) -> str | None:
  return f"{zeros} samples of 0 tokens (not drawn)" if zeros else None


def _log_axis(ax, *dists: dict[str, Any] | list) -> None:
  """A log x axis spanning the non-zero values (and the given marks), at least a decade
  wide, with plain-number ticks at 1, 2 and 5 of each decade."""
  from matplotlib import ticker  # pylint: disable=import-outside-toplevel
  values = []
  for d in dists:
    if isinstance(d, list):
      values += d
    elif d.get("count") and d["max"] >= 1:
      values += [max(1.0, d["min"]), d["max"]]
  if not values:
    return
  lo, hi = min(values) / 1.3, max(values) * 1.3
  if hi / lo < 10:
    middle = (lo * hi) ** 0.5
    lo, hi = middle / 10 ** 0.5, middle * 10 ** 0.5
  lo = max(0.8, lo)
  ax.set_xscale("log")
  ax.set_xlim(lo, hi)
  subs = (1.0, 2.0, 5.0) if hi / lo < 1000 else (1.0,)  # 3 to 12 labelled ticks
  ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
  ax.xaxis.set_major_formatter(ticker.FuncFormatter(_short_number))
  ax.xaxis.set_minor_formatter(ticker.NullFormatter())


def _short_number(value: float, _=None) -> str:
  """1, 20, 500, 2k, 10k, 1M: tick labels that stay apart."""
  for scale, suffix in ((1e6, "M"), (1e3, "k")):
    if value >= scale:
      return f"{value / scale:g}{suffix}"
  return f"{value:g}"
