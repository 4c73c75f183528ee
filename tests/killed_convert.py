"""`python killed_convert.py CONFIG OUT WHERE N [RUNNER]`: `bagel-grain convert` (16 records a
shard) killed with SIGKILL, as a preempted machine or `kill -9` would: WHERE=record, after
writing N records (mid-shard); WHERE=shard, after N shards were written whole (between
shards). With RUNNER, the conversion runs on that Beam runner, in this process."""

import os
import signal
import sys

from bagel_grain.tooling import convert


def _kill() -> None:
  os.kill(os.getpid(), signal.SIGKILL)


def main(config: str, out: str, where: str, n: int, runner: str | None = None) -> None:
  count = [0]
  if where == "record":
    framed = convert._framed_records  # pylint: disable=protected-access

    def killing_framed(*args, **kwargs):
      for record in framed(*args, **kwargs):
        if count[0] == n:
          _kill()
        count[0] += 1
        yield record
    convert._framed_records = killing_framed  # pylint: disable=protected-access
  else:
    write = convert.write_shard

    def killing_write(*args, **kwargs):
      written = write(*args, **kwargs)
      count[0] += 1
      if count[0] == n:
        _kill()
      return written
    convert.write_shard = killing_write
  if runner:
    from bagel_grain.tooling import beam_convert  # pylint: disable=import-outside-toplevel
    beam_convert.run_convert(config, out, runner, records_per_shard=16, num_threads=2)
  else:
    convert.convert_config_file(config, out, records_per_shard=16, num_threads=2,
                                progress=False)
  sys.exit("the conversion ended before the kill point")


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:])
