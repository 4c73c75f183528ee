"""The families by name: the one table that config, pipeline and converter look a group up in.

A new family is a module beside these (its `FamilyTransform` and its `FAMILY`
record) and one entry here.
"""

from __future__ import annotations

from bagel_grain.families import edit, t2i, vlm
from bagel_grain.families.family import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (t2i.FAMILY, edit.FAMILY, vlm.FAMILY)}
