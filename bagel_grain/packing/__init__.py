"""BAGEL's packing: sample layout, static-shape rows, the mixing/packing/batching stages."""

from bagel_grain.packing.bagel_dict import to_bagel_dict
from bagel_grain.packing.layout import Geometry, SampleLayout, SpecialTokens, layout_sample
from bagel_grain.packing.row import Capacities, RowBuilder, default_capacities, empty_row

__all__ = ["Capacities", "Geometry", "RowBuilder", "SampleLayout", "SpecialTokens",
           "default_capacities", "empty_row", "layout_sample", "to_bagel_dict"]
