"""The configs the command line runs by default, shipped inside the package.

`demo.yaml` reads what `bagel-grain make-sample-data` writes, `bench.yaml` what
`bagel-grain make-bench-data` writes. Their `tokenizer_path` and `dataset_info`
are relative to that data folder, which `load_shipped` takes: the config comes
from the installed package (editable or not), the data from wherever it was written.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from bagel_grain.errors import DatasetError

if TYPE_CHECKING:
  from bagel_grain.config import PipelineConfig

# Each shipped config, and the command that writes the data it reads.
DATA_MAKERS = {"demo": "make-sample-data", "bench": "make-bench-data"}


def shipped_path(name: str) -> Path:
  """The file of the shipped config `name` ("demo" or "bench")."""
  if name not in DATA_MAKERS:
    raise ValueError(f"no shipped config {name!r}; there are {sorted(DATA_MAKERS)}")
  return Path(str(resources.files(__name__).joinpath(f"{name}.yaml")))


def load_shipped(name: str, data_dir: str | os.PathLike) -> PipelineConfig:
  """The shipped config `name` reading the data in `data_dir`."""
  from bagel_grain.config import config_from_dict  # pylint: disable=import-outside-toplevel
  path, data_dir = shipped_path(name), os.path.abspath(data_dir)
  if not os.path.isfile(os.path.join(data_dir, "dataset_info.yaml")):
    raise DatasetError(f"no {name} data in {data_dir}; write it first with "
                       f"`bagel-grain {DATA_MAKERS[name]} {data_dir}`")
  raw = yaml.safe_load(path.read_text(encoding="utf-8"))
  return config_from_dict(raw, file=str(path), base_dir=data_dir)
