"""NeMo AutoModel recipe files: the data settings they hold, the trainer's sections set aside.

A NeMo BAGEL recipe describes a whole training run. The pipeline reads what
decides its data: the `dataset:` section (checked key by key, like a plain
config), the tokenizer, the worker count, the batch size and the global seed.
The other sections belong to the trainer: logged once as ignored, never refused.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from bagel_grain.config_values import did_you_mean
from bagel_grain.errors import ConfigError

log = logging.getLogger(__name__)

# Top-level sections of NeMo's BAGEL recipes (and the optional ones its recipe class
# reads) that configure the trainer; `seed` and `dataset` are ours.
TRAINER_SECTIONS = frozenset({
    "recipe", "step_scheduler", "dist_env", "tokenizer", "model", "checkpoint",
    "distributed", "dataloader", "optimizer", "lr_scheduler", "clip_grad_norm",
    "freeze_config", "ema", "wandb", "peft", "fp8", "compile"})

# (section, key, config field) read from trainer sections. For one field the first
# present wins: NeMo takes the tokenizer from `tokenizer:`, else from the model's
# checkpoint folder.
TRAINER_KEYS = (
    ("tokenizer", "pretrained_model_name_or_path", "tokenizer_path"),
    ("model", "pretrained_model_name_or_path", "tokenizer_path"),
    ("dataloader", "num_workers", "num_workers"),
    ("step_scheduler", "local_batch_size", "batch_size"),
)

# NeMo's spelling of a `dataset:` key that names a section's own file.
PATH_KEYS = {"dataset_info_path": "dataset_info", "grouped_datasets_path": "grouped_datasets"}


def flatten(raw: Mapping, *, file: str, fields: set[str]) -> tuple[dict[str, Any], dict[str, str]]:
  """The flat config mapping of a plain config or a NeMo recipe.

  Returns it with, for each key that came from elsewhere, the name the file wrote
  it under (`dataset.max_num_tokens`, `dataloader.num_workers`), for error messages.
  `fields` are the keys a flat config may hold. Unknown top-level keys are left for
  the caller to refuse; an unknown key under `dataset:` is refused here.
  """
  flat = {k: v for k, v in raw.items() if k != "dataset" and k not in TRAINER_SECTIONS}
  written: dict[str, str] = {}
  nested = raw.get("dataset")
  if nested is not None:
    if not isinstance(nested, Mapping):
      raise ConfigError("`dataset` must be a mapping", file=file, key="dataset")
    for key, value in nested.items():
      if key == "_target_":  # NeMo's builder; the pipeline is ours
        continue
      field = PATH_KEYS.get(key, key)
      if field not in fields:
        known = fields | PATH_KEYS.keys()
        raise ConfigError(f"unknown key under `dataset:`; {did_you_mean(key, known)}",
                          file=file, key=f"dataset.{key}")
      _put(flat, written, field, value, f"dataset.{key}", file)
  sections = {k: v for k, v in raw.items() if k in TRAINER_SECTIONS}
  read: dict[str, str] = {}  # field -> the trainer key it was read from
  for section, key, field in TRAINER_KEYS:
    values = sections.get(section)
    if field in read or not isinstance(values, Mapping) or values.get(key) is None:
      continue
    _put(flat, written, field, values[key], f"{section}.{key}", file)
    read[field] = f"{section}.{key}"
  if sections:
    log.warning("%s: ignoring trainer sections %s (read from them: %s)", file, ", ".join(sections),
             ", ".join(read.values()) or "nothing")
  return flat, written


def _put(flat: dict[str, Any], written: dict[str, str], field: str, value: Any, name: str,
         file: str) -> None:
  if field in flat:
    raise ConfigError(f"`{field}` is given twice, as `{written.get(field, field)}` and `{name}`",
                      file=file, key=name)
  flat[field] = value
  written[field] = name
