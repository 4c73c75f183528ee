"""A picture and a summary of one packed row: what went where, who sees whom, which images.

The PNG has, from top to bottom: one colour band per position for the sample
(segment), the split, the modality (token type), the split's attention mode and
the loss (CE / MSE), with a legend; the attention mask of the whole row (query
rows, key columns, coloured by sample; sampled on a grid when L is larger than
the picture), then the mask of one sample enlarged, coloured by the key's split
mode, where text's causal triangles are visible; thumbnails of the row's ViT
images (patches put back on their grid) and VAE images (cropped to their real
size). Pillow only; no JAX.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from bagel_grain.config import PipelineConfig
from bagel_grain.errors import StreamEndedError
from bagel_grain.packing.attention import row_mask
from bagel_grain.packed_row import MODE_NAMES

_PALETTE = np.array([
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (188, 189, 34), (23, 190, 207), (174, 199, 232),
    (255, 187, 120), (152, 223, 138)], np.uint8)
_PAD = np.array((40, 40, 40), np.uint8)
# The legend's colours: each used once, none the padding's or the hidden mask's.
_TYPE_COLOURS = np.array([_PAD, (31, 119, 180), (44, 160, 44), (255, 127, 14)], np.uint8)
_TYPE_NAMES = ("pad", "text", "ViT", "VAE")
_MODE_COLOURS = np.array([(148, 103, 189), (23, 190, 207), (214, 39, 40)], np.uint8)
_CE, _MSE = np.array((227, 119, 194), np.uint8), np.array((188, 189, 34), np.uint8)
_NO_LOSS, _HIDDEN = np.array((215, 215, 215), np.uint8), np.array((245, 245, 245), np.uint8)
LEGEND = (  # (band, [(name, colour)]): what the modality, mode and loss bands show
    ("modality", [("text", _TYPE_COLOURS[1]), ("ViT", _TYPE_COLOURS[2]),
                  ("VAE", _TYPE_COLOURS[3]), ("pad", _PAD)]),
    ("mode", list(zip(MODE_NAMES, _MODE_COLOURS))),
    ("loss", [("CE", _CE), ("MSE", _MSE), ("none", _NO_LOSS)]),
)
_LABEL_W, _BAND_H, _GAP, _THUMB_H, _AXIS_H = 70, 14, 4, 96, 30
_TEXT_W = 440  # the least width beside the labels: room for the legend and the titles


def _ids_colours(ids: np.ndarray) -> np.ndarray:
  """A palette colour per id (cycling), dark grey for 0."""
  out = _PALETTE[(np.maximum(ids, 1) - 1) % len(_PALETTE)]
  out[ids == 0] = _PAD
  return out


def vit_images(row: dict[str, Any], vit_patch_size: int,
               max_num_patch_per_side: int = 70) -> list[np.ndarray]:
  """The row's ViT images, rebuilt from patches and their extrapolate position ids
  (`row * max_num_patch_per_side + col`), in image-id order."""
  p = vit_patch_size
  ids = np.asarray(row["vit_image_ids"])
  patches = np.asarray(row["vit_patches"])
  pos = np.asarray(row["vit_position_ids"])
  out = []
  for image_id in range(1, int(ids.max(initial=0)) + 1):
    sel = ids == image_id
    r, c = np.divmod(pos[sel], max_num_patch_per_side)
    canvas = np.zeros(((r.max() + 1) * p, (c.max() + 1) * p, 3), np.uint8)
    for patch, y, x in zip(patches[sel], r, c):
      canvas[y * p:(y + 1) * p, x * p:(x + 1) * p] = patch.reshape(p, p, 3)
    out.append(canvas)
  return out


def vae_images(row: dict[str, Any]) -> list[np.ndarray]:
  """The row's VAE images, cropped to their real height and width."""
  return [np.asarray(im)[:h, :w] for im, (h, w) in zip(row["vae_images"], row["vae_image_hw"])
          if h > 0 and w > 0]


def summarize_row(row: dict[str, Any]) -> str:
  """A few lines: samples, tokens per modality, splits with their modes, fill, losses."""
  token_type = np.asarray(row["token_type"])
  seg = np.asarray(row["segment_ids"])
  split = np.asarray(row["split_ids"])
  lens = np.asarray(row["split_lens"])
  modes = np.asarray(row["split_modes"])
  length = token_type.shape[0]
  n = int(row["num_tokens"])
  num_samples = int(row["num_samples"])
  counts = np.bincount(token_type.astype(np.int64), minlength=4)
  lines = [f"row: L={length}, {num_samples} samples, {n} tokens ({n / length:.1%} fill)",
           "tokens: " + ", ".join(f"{name} {int(c)}" for name, c in zip(_TYPE_NAMES, counts))]
  keys = row.get("sample_keys") or ()
  for s in range(1, num_samples + 1):
    at = np.flatnonzero(seg == s)
    sample_splits = np.unique(split[at])
    desc = " ".join(f"{MODE_NAMES[int(modes[k - 1])]}:{int(lens[k - 1])}"
                    for k in sample_splits)
    key = keys[s - 1] if s - 1 < len(keys) else None
    origin = f" {key[0]} {os.path.basename(str(key[3]))}" if key and len(key) > 3 else ""
    lines.append(f"  sample {s}{origin}: positions {at[0]}..{at[-1]}, "
                 f"{len(sample_splits)} splits [{desc}]")
  num_splits = int((lens > 0).sum())
  mode_counts = np.bincount(modes[:num_splits].astype(np.int64), minlength=3)
  lines.append(f"splits: {num_splits} (" + ", ".join(
      f"{name} {int(c)}" for name, c in zip(MODE_NAMES, mode_counts)) + ")")
  ce = np.asarray(row["ce_weights"])
  lines.append(f"images: ViT {int(np.asarray(row['vit_image_ids']).max(initial=0))} "
               f"({int(row['num_vit_tokens'])} patches), VAE {len(vae_images(row))} "
               f"({int(row['num_vae_tokens'])} latent tokens)")
  lines.append(f"loss: CE on {int((ce > 0).sum())} tokens (weight sum {ce.sum():.2f}), "
               f"MSE on {int(np.asarray(row['mse_mask']).sum())} tokens")
  return "\n".join(lines)


def _thumbnail(image: np.ndarray) -> Image.Image:
  im = Image.fromarray(image)
  w = max(1, round(im.width * _THUMB_H / max(im.height, 1)))
  return im.resize((w, _THUMB_H), Image.Resampling.BILINEAR)


def _zoom_sample(seg: np.ndarray, split: np.ndarray, modes: np.ndarray,
                 num_samples: int) -> int:
  """The sample to enlarge: causal text beside other modes, the largest causal share."""
  def score(s):
    kinds = modes[np.maximum(split[seg == s], 1) - 1]
    causal = float(np.mean(kinds == 0))
    return 0.0 < causal < 1.0, causal
  return max(range(1, num_samples + 1), key=score)


def _legend(draw, font, x0: int, top: int, width: int) -> int:
  """Draws the colour legend from (x0, top), wrapping at `width`; returns its height."""
  x, y = x0, top
  for title, entries in LEGEND:
    need = draw.textlength(title, font=font) + 6 + sum(
        22 + draw.textlength(name, font=font) for name, _ in entries)
    if x > x0 and x + need > x0 + width:
      x, y = x0, y + _BAND_H
    draw.text((x, y), title, fill=(90, 90, 90), font=font)
    x += draw.textlength(title, font=font) + 6
    for name, colour in entries:
      draw.rectangle((x, y + 2, x + 9, y + 11), fill=tuple(int(v) for v in colour))
      draw.text((x + 12, y), name, fill=(0, 0, 0), font=font)
      x += 22 + draw.textlength(name, font=font)
    x += 14
  return y + _BAND_H - top


def axis_ticks(positions: np.ndarray, end: int) -> list[tuple[int, int]]:
  """(pixel, position) of an axis's 5 ticks: the span's start and quarters, each at the
  pixel showing it, and its end (`end`, one past the last position) at the picture's edge.
  `positions[i]` is the first position pixel i shows. Labels are the round positions
  (1152, 1536 for a row of 1536), not what a sampled pixel happens to show."""
  first = int(positions[0])
  quarters = [first + k * (end - first) // 4 for k in range(4)]
  # The first pixel showing the position (an enlarged span shows it on several), else the
  # pixel whose sampled range holds it.
  left = np.searchsorted(positions, quarters, side="left")
  right = np.searchsorted(positions, quarters, side="right") - 1
  return [(int(a if a < len(positions) and positions[a] == p else b), p)
          for a, b, p in zip(left, right, quarters)] + [(len(positions), end)]


def _mask_panel(canvas, draw, font, picture: np.ndarray, positions: np.ndarray, end: int,
                top: int, title: str) -> int:
  """The mask picture at (_LABEL_W, top + 14) under its title, with position axes
  (`axis_ticks`); returns the height used."""
  size = picture.shape[0]
  draw.text((_LABEL_W, top), title, fill=(0, 0, 0), font=font)
  top += 14
  canvas.paste(Image.fromarray(picture), (_LABEL_W, top))
  draw.rectangle((_LABEL_W - 1, top - 1, _LABEL_W + size, top + size), outline=(0, 0, 0))
  for i, position in axis_ticks(positions, end):
    label = str(position)
    draw.line((_LABEL_W - 4, top + i, _LABEL_W - 1, top + i), fill=(0, 0, 0))
    draw.text((_LABEL_W - 6, top + i), label, fill=(0, 0, 0), font=font, anchor="rm")
    draw.line((_LABEL_W + i, top + size, _LABEL_W + i, top + size + 3), fill=(0, 0, 0))
    draw.text((_LABEL_W + i, top + size + 4), label, fill=(0, 0, 0), font=font,
              anchor="ma" if 0 < i < size else "la" if i == 0 else "ra")
  draw.text((2, top + size // 2 + 12), "query", fill=(90, 90, 90), font=font)
  draw.text((_LABEL_W + size // 2, top + size + 16), "key position", fill=(90, 90, 90),
            font=font, anchor="ma")
  return 14 + size + _AXIS_H


def inspect_row(row: dict[str, Any], out_png: str, *, vit_patch_size: int,
                max_num_patch_per_side: int = 70, width: int = 768) -> str:
  """Writes the picture of one packed row (numpy arrays, no batch dim) to `out_png`.

  Returns `summarize_row(row)`. Positions are sampled on `width` columns when L
  is larger; the mask is evaluated exactly at the sampled (query, key) pairs.
  """
  seg = np.asarray(row["segment_ids"])
  split = np.asarray(row["split_ids"])
  token_type = np.asarray(row["token_type"])
  modes = np.asarray(row["split_modes"])
  length = seg.shape[0]
  cols = min(width, length)
  at = (np.arange(cols) * length) // cols  # the position each column shows

  token_mode = np.where(split > 0, modes[np.maximum(split - 1, 0)], 0)
  loss = np.where((seg > 0)[:, None], _NO_LOSS, _PAD)
  loss[np.asarray(row["ce_weights"]) > 0] = _CE
  loss[np.asarray(row["mse_mask"])] = _MSE
  bands = [
      ("sample", _ids_colours(seg)),
      ("split", _ids_colours(split)),
      ("modality", _TYPE_COLOURS[token_type]),
      ("mode", np.where((split > 0)[:, None], _MODE_COLOURS[token_mode], _PAD)),
      ("loss", loss),
  ]
  mask = row_mask(seg[at], split[at], modes)
  mask_rgb = np.where(mask[..., None], _ids_colours(seg[at])[None, :, :], _HIDDEN)
  # One sample enlarged (or sampled) to the same size: nearest positions.
  zoomed = _zoom_sample(seg, split, modes, int(row["num_samples"]))
  inside = np.flatnonzero(seg == zoomed)
  zoom_at = inside[0] + (np.arange(cols) * len(inside)) // cols
  zoom_mask = row_mask(seg[zoom_at], split[zoom_at], modes)
  zoom_rgb = np.where(zoom_mask[..., None], _MODE_COLOURS[token_mode[zoom_at]][None], _HIDDEN)

  thumbs = [(f"ViT {i + 1}", _thumbnail(im)) for i, im in enumerate(
      vit_images(row, vit_patch_size, max_num_patch_per_side))]
  thumbs += [(f"VAE {i + 1}", _thumbnail(im)) for i, im in enumerate(vae_images(row))]
  font = ImageFont.load_default()
  total_w = _LABEL_W + max(cols, _TEXT_W)
  thumb_rows, x, y = [], 0, 0
  for name, im in thumbs:  # wrap thumbnails into lines of the picture's width
    if x and x + im.width > total_w:
      x, y = 0, y + _THUMB_H + 16
    thumb_rows.append((name, im, x, y))
    x += max(im.width, 48) + _GAP  # room for the label under narrow images
  thumbs_h = (y + _THUMB_H + 16) if thumbs else 0

  scratch = ImageDraw.Draw(Image.new("RGB", (1, 1)))
  legend_h = _legend(scratch, font, _LABEL_W, 0, total_w - _LABEL_W)
  bands_h = len(bands) * (_BAND_H + 2) + legend_h
  panel_h = 14 + cols + _AXIS_H
  height = bands_h + _GAP + 2 * (panel_h + _GAP) + thumbs_h
  canvas = Image.new("RGB", (total_w, height), (255, 255, 255))
  draw = ImageDraw.Draw(canvas)
  for i, (name, colours) in enumerate(bands):
    top = i * (_BAND_H + 2)
    strip = np.repeat(colours[at][None], _BAND_H, axis=0).astype(np.uint8)
    canvas.paste(Image.fromarray(strip), (_LABEL_W, top))
    draw.text((2, top), name, fill=(0, 0, 0), font=font)
  _legend(draw, font, _LABEL_W, len(bands) * (_BAND_H + 2), total_w - _LABEL_W)
  top = bands_h + _GAP
  top += _mask_panel(canvas, draw, font, mask_rgb.astype(np.uint8), at, length, top,
                     "attention mask of the row (query down, key across), coloured by "
                     "sample") + _GAP
  box = [int(np.searchsorted(at, p)) for p in (inside[0], inside[-1] + 1)]
  mask_top = bands_h + _GAP + 14
  draw.rectangle((_LABEL_W + box[0], mask_top + box[0], _LABEL_W + box[1],
                  mask_top + box[1]), outline=(0, 0, 0))
  top += _mask_panel(canvas, draw, font, zoom_rgb.astype(np.uint8), zoom_at, inside[-1] + 1,
                     top,
                     f"sample {zoomed} (positions {inside[0]}..{inside[-1]}, boxed above), "
                     "coloured by the key's split mode") + _GAP
  for name, im, x, y in thumb_rows:
    canvas.paste(im, (x, top + y + 14))
    draw.text((x, top + y), name, fill=(0, 0, 0), font=font)
  canvas.save(out_png)
  return summarize_row(row)


def stream_ended(rows: int, num_epochs: int | None) -> str:
  """How a command says a finite stream ran out."""
  return f"the stream ended after {rows} rows (num_epochs: {num_epochs})"


def inspect_pipeline_row(cfg: PipelineConfig, out_png: str, *, index: int = 0,
                         seed: int | None = None, workers: int = 0) -> str:
  """`bagel-grain inspect`: the `index`-th packed row (0-based) of the config's stream
  (process 0 of 1), drawn to `out_png`; returns the summary."""
  # pylint: disable=import-outside-toplevel
  from bagel_grain.pipeline import build_pipeline
  from bagel_grain.tokenizer import load_tokenizer

  it = iter(build_pipeline(cfg, load_tokenizer(cfg.tokenizer_path), seed=seed, batch_size=1,
                           workers=workers))
  try:
    for rows in range(index + 1):
      try:
        batch = next(it)
      except StopIteration:
        raise StreamEndedError(f"{stream_ended(rows, cfg.num_epochs)}, before row {index} "
                               f"(0-based): ask for an index below {rows}, or raise "
                               "num_epochs") from None
  finally:
    it.close()
  row = {name: value[0] for name, value in batch.items()}
  return inspect_row(row, out_png, vit_patch_size=cfg.vit_patch_size,
                     max_num_patch_per_side=cfg.max_num_patch_per_side)
