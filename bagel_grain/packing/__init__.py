"""BAGEL's packing: sample layout, static-shape rows, the mix/pack IterDataset."""

from bagel_grain.packing.bagel_dict import to_bagel_dict
from bagel_grain.packing.layout import Geometry, SampleLayout, SpecialTokens, layout_sample
from bagel_grain.packing.row import Capacities, RowBuilder, default_capacities

__all__ = ["Capacities", "Geometry", "RowBuilder", "SampleLayout", "SpecialTokens",
           "default_capacities", "layout_sample", "to_bagel_dict"]
