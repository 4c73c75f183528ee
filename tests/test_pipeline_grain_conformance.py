"""Grain's own checkpoint check on the pipeline: `assert_equal_output_after_checkpoint`
saves the state before every batch of a finite stream, restores a fresh iterator at
each, and requires the same structure at every step, the same state back and the same
remaining batches."""

import dataclasses
import weakref

import grain
import pytest

from bagel_grain import build_pipeline


class _Counted(grain.IterDataset):
  """The pipeline, its iterators counted and, should the checker keep any, closed at the
  end (worker processes included). Held weakly: Grain's checker closes none, and an
  iterator it lets go of closes when collected."""

  def __init__(self, ds):
    super().__init__(ds)
    self.opened = []

  def __iter__(self):
    it = self._parent.__iter__()
    self.opened.append(weakref.ref(it))
    return it


CASES = {  # (workers, logical_shards, process_index, process_count)
    "0_workers": (0, None, 0, 1),
    "2_workers": (2, None, 0, 1),
    "logical_shards_4": (0, 4, 0, 1),
    "2_workers_logical_shards_4": (2, 4, 0, 1),
    "process_0_of_2": (0, None, 0, 2),
    "process_1_of_2": (0, None, 1, 2),
}


@pytest.mark.parametrize("case", CASES)
def test_grains_checkpoint_check_passes(demo_config, demo_tokenizer, case):
  workers, shards, index, count = CASES[case]
  cfg = dataclasses.replace(demo_config, num_epochs=1, logical_shards=shards)
  ds = _Counted(build_pipeline(cfg, demo_tokenizer, batch_size=4, workers=workers,
                               process_index=index, process_count=count))
  try:
    grain.experimental.assert_equal_output_after_checkpoint(ds)
  finally:
    for ref in ds.opened:
      if (it := ref()) is not None:
        it.close()
  assert len(ds.opened) > 2  # the stream had batches to restore at
