"""Records and samples of one family, for the family tests: built as the pipeline builds them."""

import numpy as np

from bagel_grain.drops import Dropped
from bagel_grain.pipeline import family_transform, group_source
from bagel_grain.sources.records import Record, ShuffledRecords


def family_dataset(cfg, name, tokenizer, *, seed):
  """A group's records in epoch order and, element for element, its family's samples."""
  index = [g.name for g in cfg.groups].index(name)
  records = ShuffledRecords(group_source(cfg, index), seed=seed)
  return records, records.random_map(family_transform(cfg, index, tokenizer), seed=seed)


def make_record(fields, error=None, record_id="mem.parquet#0"):
  """A record read from nowhere: what a source would hand the family."""
  return Record(index=0, epoch=0, record_id=record_id, dataset=0, fields=fields, error=error)


def shape(sample):
  """The plan as (type, enable_cfg, loss) triples."""
  return [(item.type, item.enable_cfg, item.loss) for item in sample.plan]


def assert_same_outcome(a, b):
  """Two family outputs equal in everything but the record id."""
  assert type(a) is type(b)
  if isinstance(a, Dropped):
    assert a.reason == b.reason
    return
  assert a.plan == b.plan and a.num_tokens == b.num_tokens and a.notes == b.notes
  assert len(a.text_ids) == len(b.text_ids) and len(a.images) == len(b.images)
  for x, y in zip(a.text_ids + a.images, b.text_ids + b.images):
    np.testing.assert_array_equal(x, y)
