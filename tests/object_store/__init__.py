"""Test infrastructure for data in buckets: local S3 and GCS servers, and proxies in front
of them that add latency (`latency_proxy`) or faults (`fault_proxy`). Used by the tests and
by `tools/storage_bench.py`; never imported by the package."""

from .latency_proxy import LatencyProxy
from .servers import FaultProxy, LocalObjectStore

__all__ = ["FaultProxy", "LatencyProxy", "LocalObjectStore"]
