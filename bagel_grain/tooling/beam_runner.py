"""What the Beam pipelines of `bagel-grain index / convert / audit --runner` share.

Apache Beam is an extra (`bagel_grain[beam]`) installed in an environment of its
own (`.venv-beam`, constraints-beam.txt: Beam caps pillow, pyarrow and protobuf
below the loader's pins). The loader never imports this module; the commands
import it only when `--runner` is given.
"""

from __future__ import annotations

from typing import Any, Sequence

from bagel_grain.errors import BagelGrainError

# The runner's own options pass through: any `--name value` the command does not know.
RUNNER_HELP = ("the Beam runner: DirectRunner here (add --direct_num_workers N "
               "--direct_running_mode multi_processing), DataflowRunner, FlinkRunner, "
               "SparkRunner or PortableRunner on a cluster; every option the command does not "
               "know passes to Beam (docs/beam.md). Without it the command runs in this "
               "process")


class BeamMissing(BagelGrainError):
  """`--runner` was given in an environment without Apache Beam."""


def beam():
  """The `apache_beam` module, or an error saying where Beam is installed."""
  try:
    import apache_beam  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise BeamMissing(
        "--runner needs Apache Beam, which the loader's environment does not hold: run the "
        "command from the Beam venv (`make beam-install`, then `.venv-beam/bin/bagel-grain "
        "...`) or install `bagel_grain[beam]` with -c constraints-beam.txt in an "
        "environment of its own") from None
  return apache_beam


def pipeline_options(runner: str, extra: Sequence[str] = ()) -> Any:
  """Beam's PipelineOptions from `--runner` and the pass-through flags. The pipelines'
  functions live in bagel_grain modules, which every worker imports itself (on a
  cluster: `--extra_package` with bagel_grain's wheel, or a worker image; docs/beam.md)."""
  return beam().options.pipeline_options.PipelineOptions(["--runner", runner, *extra])
