"""How many storage requests a process overlaps, and how many connections it keeps open.

An object store answers a request after a round trip (20-150 ms) whatever its size, so
the pipeline overlaps requests on threads instead of sending them one after another;
each request in flight holds one HTTP connection of its own (`remote.http`).

- `BUILD_THREADS`: groups built at once (each lists its folders and reads its index
  files). The demo's three groups at 50 ms a request: 1.0 s one after another, 0.36 s
  together.
- `FOOTER_THREADS`: the parquet footers of one folder read at once without an index
  (and the files `bagel-grain index` reads). Inside a build's group: up to
  `BUILD_THREADS * FOOTER_THREADS` requests at once, which the store takes.
- `IDLE_PER_HOST`: connections kept open for the next request to a host. A connection
  given back to a full pool is closed, and the next request opens a new one (a TCP
  and TLS handshake: one to three round trips before its first byte), so the bound
  covers the requests a process makes at once in steady state: the read-ahead's
  threads (`sources.readahead.THREADS`, up to `MAX_THREADS` = 64 per group as latency
  asks). An A/B of the demo from S3 at 50 ms with read-ahead counted 1.7-5 new
  connections per row at 16, 0.4-0.7 at 64 (on a machine loaded 10-17 on 2 cores,
  where few requests overlap, 16 and 64 measured alike: 0-0.44 per row in steady
  state). An idle socket costs a file descriptor and a few KiB.
"""

BUILD_THREADS = 16
FOOTER_THREADS = 16
IDLE_PER_HOST = 64
