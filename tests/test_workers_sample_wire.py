"""A prepared sample crosses from a worker without pickle, exactly as pickle carried it."""

import dataclasses
import gc
import pickle

import numpy as np
import pytest

from packer_samples import make_sample
from bagel_grain.drops import DropReason, Note
from bagel_grain.packing.layout import SampleLayout
from bagel_grain.packing.row import Usage
from bagel_grain.workers import sample_wire


def assert_same(got, want):
  assert type(got) is type(want) and got.key == want.key
  assert (got.packed_size, got.image_tokens, got.notes) == (
      want.packed_size, want.image_tokens, want.notes)
  assert all(type(n) is Note for n in got.notes)
  for field in dataclasses.fields(SampleLayout):
    a, b = getattr(got.layout, field.name), getattr(want.layout, field.name)
    for x, y in (zip(a, b, strict=True) if field.name == "vae_images" else [(a, b)]):
      assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), field.name
      assert not x.flags.writeable


@pytest.mark.parametrize("vit,vae", [(False, False), (True, False), (True, True)])
def test_a_sample_over_the_socket_equals_its_pickle(vit, vae):
  sample = dataclasses.replace(make_sample(2, 7, 13, vit=vit, vae=vae), image_tokens=5,
                               notes=(Note.EMPTY_CAPTION,))
  payload, buffers = sample_wire.encode(sample)
  assert sample_wire.is_sample(payload)
  got = sample_wire.decode(payload, [bytes(b.raw()) for b in buffers])
  assert_same(got, pickle.loads(pickle.dumps(sample, protocol=5)))


def test_an_image_shared_by_two_fields_stays_one_array():
  sample = make_sample(0, 1, 4, vae=True)
  image = sample.layout.vae_images[0]
  sample = dataclasses.replace(sample, layout=dataclasses.replace(
      sample.layout, vae_images=(image, image)))
  payload, buffers = sample_wire.encode(sample)
  got = sample_wire.decode(payload, [bytes(b.raw()) for b in buffers])
  assert got.layout.vae_images[0] is got.layout.vae_images[1]


def test_a_sample_in_the_slab_is_read_only_views_that_hold_its_region(slab_pair):
  worker, main = slab_pair
  sample = make_sample(1, 3, 9, vit=True, vae=True)
  payload, buffers = sample_wire.encode(sample)
  placed = worker.place(buffers)
  got = sample_wire.decode(payload, main.buffers(placed))
  assert_same(got, sample)
  ids = got.layout.text_ids
  del got
  gc.collect()
  assert main.take_freed() == []
  del ids
  assert main.take_freed() == [placed[0]]


def test_anything_but_a_plain_prepared_sample_goes_as_a_pickle():
  sample = make_sample(0, 0, 4)
  assert sample_wire.encode(make_sample(0, 0, 4, drop_reason=DropReason.BAD_IMAGE)) is None
  assert sample_wire.encode({"a": 1}) is None
  strided = dataclasses.replace(sample.layout, text_ids=np.arange(20, dtype=np.int32)[::2])
  assert sample_wire.encode(dataclasses.replace(sample, layout=strided)) is None
  assert sample_wire.encode(dataclasses.replace(sample, notes=("free text",))) is None
  assert not sample_wire.is_sample(pickle.dumps(sample, protocol=5))


def test_the_sample_crosses_with_its_row_usage():
  # The packer asks every sample's usage at once: it crosses in the header, worked out by
  # the worker, rather than again in the main process.
  sample = make_sample(1, 2, 11, vit=True, vae=True)
  payload, buffers = sample_wire.encode(sample)
  got = sample_wire.decode(payload, [bytes(b.raw()) for b in buffers])
  assert "usage" in vars(got)  # set, not to be worked out on first use
  assert got.usage == Usage.of(sample.layout) and type(got.usage) is Usage


def test_a_sample_decoded_from_its_slab_region_is_views_of_that_region(slab_pair):
  worker, main = slab_pair
  sample = make_sample(0, 5, 7, vit=True, vae=True)
  payload, buffers = sample_wire.encode(sample)
  placed = worker.place(buffers)
  region, offsets = main.region(placed)
  got = sample_wire.decode(payload, region, offsets)
  assert_same(got, sample)
  assert all(a.base is region for a in (got.layout.text_ids, *got.layout.vae_images))
  del region, got
  gc.collect()
  assert main.take_freed() == [placed[0]]
