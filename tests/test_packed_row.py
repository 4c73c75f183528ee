"""The packed row's one field table: empty rows, codes, pixel values and docs follow it."""

from __future__ import annotations

import ast
import typing
from importlib import resources
from pathlib import Path

import numpy as np

import bagel_grain
from bagel_grain.packed_row import (
    MODE_NAMES, PIXEL_VALUES, ROW_FIELDS, ROW_SPEC, PackedBatch, PackedRow, SplitMode,
    TokenType, fields_markdown)
from bagel_grain.packing.row import Capacities, empty_row

ROOT = Path(__file__).resolve().parents[1]
CAPS = Capacities(tokens=256, vit_patches=40, vae_tokens=30, vae_images=3, vae_image_size=32,
                  splits=20, vit_patch_size=2)


def test_empty_row_has_every_field_with_its_shape_dtype_and_fill():
  row = empty_row(CAPS)
  assert tuple(row) == ROW_FIELDS == tuple(typing.get_type_hints(PackedRow))
  # A few fields written out by hand: the symbols resolve to the capacities.
  assert row["text_ids"].shape == (256,) and row["text_ids"].dtype == np.int32
  assert row["vit_patches"].shape == (40, 12) and row["vit_patches"].dtype == np.uint8
  assert row["vae_images"].shape == (3, 32, 32, 3)
  assert row["vae_image_hw"].shape == (3, 2) and row["split_modes"].shape == (20,)
  assert row["num_samples"].shape == () and row["mse_mask"].dtype == bool
  # The token-index sentinel is L: a scatter with mode="drop" writes nowhere.
  assert (row["vit_token_index"] == 256).all() and (row["vae_token_index"] == 256).all()
  others = [name for name in ROW_FIELDS if name not in ("vit_token_index", "vae_token_index")]
  assert not any(row[name].any() for name in others)


def test_a_batch_of_empty_rows_adds_a_leading_dimension():
  batch = empty_row(CAPS, (4,))
  for name, array in empty_row(CAPS).items():
    assert batch[name].shape == (4, *array.shape) and batch[name].dtype == array.dtype


def test_every_field_says_what_it_means():
  for name, field in ROW_SPEC.items():
    assert field.name == name and len(field.meaning) > 10
    assert set(field.symbols) <= {"L", "K", "V", "P", "T", "I", "S", "2", "3"}


def test_a_batch_is_a_row_plus_its_sample_keys():
  assert set(typing.get_type_hints(PackedBatch)) == set(ROW_FIELDS) | {"sample_keys"}


def test_codes_are_upstreams():
  # Upstream's token kinds and its attention-mode strings, in the order of their codes.
  assert [int(t) for t in (TokenType.PAD, TokenType.TEXT, TokenType.VIT, TokenType.VAE)] == [
      0, 1, 2, 3]
  assert MODE_NAMES == ("causal", "full", "noise")
  assert [SplitMode[name.upper()] for name in MODE_NAMES] == [0, 1, 2]


def test_pixel_values_are_torchvisions_float32_arithmetic():
  x = np.arange(256, dtype=np.uint8).astype(np.float32)
  want = (x / np.float32(255) - np.float32(0.5)) / np.float32(0.5)
  assert PIXEL_VALUES.dtype == np.float32 and np.array_equal(PIXEL_VALUES, want)
  assert PIXEL_VALUES[0] == -1.0 and PIXEL_VALUES[255] == 1.0


def test_docs_table_is_the_spec():
  doc = (ROOT / "docs" / "packed_row.md").read_text()
  assert fields_markdown() in doc, (
      "docs/packed_row.md is out of date; paste in packed_row.fields_markdown():\n"
      + fields_markdown())


def test_public_names_at_the_top_level():
  for name in ("PackedRow", "PackedBatch", "TokenType", "SplitMode", "to_bagel_dict"):
    assert name in bagel_grain.__all__ and hasattr(bagel_grain, name)
  assert resources.files("bagel_grain").joinpath("py.typed").is_file()
  assert 'bagel_grain = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()


def test_the_codes_live_in_a_numpy_only_module_that_the_device_side_reads():
  tree = ast.parse((ROOT / "bagel_grain" / "packed_row.py").read_text())
  imported = {alias.name.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.Import) for alias in node.names}
  imported |= {node.module.split(".")[0] for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom)}
  assert imported == {"__future__", "dataclasses", "enum", "typing", "numpy"}
  from bagel_grain.jax import attention, prepare  # pylint: disable=import-outside-toplevel
  assert attention.SplitMode is SplitMode and prepare.TokenType is TokenType
  assert prepare.PIXEL_VALUES is PIXEL_VALUES
