"""Shared fixtures: the generated demo dataset, its config and its tokenizer."""

import functools
import os

# Before anything imports jax: the JAX tests run on 8 simulated CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path

import pytest
import yaml

from bagel_grain.tooling import demo_data
from bagel_grain.config import config_from_dict
from bagel_grain.configs import load_shipped
from bagel_grain.tokenizer import load_tokenizer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def redirected_config(name: str, demo_dir: Path):
  """configs/NAME with `dataset_info` and `tokenizer_path` pointing at `demo_dir`."""
  path = CONFIGS / name
  raw = yaml.safe_load(path.read_text())
  raw["dataset_info"] = str(demo_dir / "dataset_info.yaml")
  raw["tokenizer_path"] = str(demo_dir / "tokenizer")
  return config_from_dict(raw, file=str(path), base_dir=str(CONFIGS))


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
  return demo_data.make_sample_data(tmp_path_factory.mktemp("demo_data"))


@pytest.fixture(scope="session")
def load_redirected(demo_dir):
  """`load_redirected("example.yaml")`: a config of configs/, on the generated demo data."""
  return lambda name: redirected_config(name, demo_dir)


@pytest.fixture(scope="session")
def demo_config(demo_dir):
  return load_shipped("demo", demo_dir)


@pytest.fixture(scope="session")
def demo_tokenizer(demo_dir):
  # The tokenizer.json file loads without importing transformers; same ids as the folder.
  return load_tokenizer(demo_dir / "tokenizer" / "tokenizer.json")


@pytest.fixture(scope="session")
def demo_epoch(demo_config, demo_tokenizer):
  """`demo_epoch(name)`: one epoch of a demo group as [(record, sample)], made once."""
  from family_records import family_dataset  # pylint: disable=import-outside-toplevel

  @functools.cache
  def epoch(name):
    records, samples = family_dataset(demo_config, name, demo_tokenizer, seed=11)
    return [(records[i], samples[i]) for i in range(records.records_per_epoch)]
  return epoch


@pytest.fixture
def slab_pair():
  """A 1 MiB slab as a worker and as the main process map it (skipped without memfd)."""
  from bagel_grain.workers import slab as slabs
  fd = slabs.create(1 << 20)
  if fd is None:
    pytest.skip("no memfd on this system")
  pair = slabs.WorkerSlab(os.dup(fd), 1 << 20), slabs.MainSlab(fd, 1 << 20)
  os.close(fd)
  return pair
