"""Storage that blips: transient failures retried to a deadline, definite answers final."""

import logging
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from bagel_grain import storage
from bagel_grain.errors import StorageUnavailableError
from bagel_grain.storage import RetryPolicy, element_scope, is_transient

# Messages pyarrow 26 gave against moto, the GCS emulator and a fault proxy in front.
S3_REFUSED = ("When reading information for key 'a/x.bin' in bucket 'bucket-one': AWS Error "
              "NETWORK_CONNECTION during HeadObject operation: curlCode: 7, Could not connect "
              "to server")
S3_503 = ("When reading information for key 'a/x.bin' in bucket 'bucket-one': AWS Error "
          "UNKNOWN (HTTP status 503) during HeadObject operation: No response body.")
S3_STALL = ("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 28, Timeout "
            "was reached")
GCS_RESET = ("google::cloud::Status(UNAVAILABLE: Retry policy exhausted, with a last message "
             "of PerformWork() - CURL error [18]=Transferred a partial file")
GCS_404 = "google::cloud::Status(NOT_FOUND: Permanent error, with a last message of 404"
@pytest.fixture(autouse=True)
def quiet_outage(monkeypatch):
  """Each test starts with storage not failing (the outage log is per process)."""
  monkeypatch.setattr(storage, "OUTAGE", storage._Outage())  # pylint: disable=protected-access


FAST = RetryPolicy(timeout_s=30, first_wait_s=0.0, longest_wait_s=0.0)


@pytest.mark.parametrize("error, transient", [
    (OSError(S3_REFUSED), True), (OSError(S3_503), True), (OSError(S3_STALL), True),
    (OSError(GCS_RESET), True), (ConnectionResetError(), True), (TimeoutError(), True),
    (FileNotFoundError(2, GCS_404), False), (PermissionError(13, "denied"), False),
    (OSError("AWS Error ACCESS_DENIED during GetObject operation"), False),
    (OSError(5, "Input/output error"), False), (ValueError("x"), False)])
def test_failures_are_sorted_into_transient_and_definite(error, transient):
  assert is_transient(error) is transient


def _failing(times: int, error: Exception, value="bytes"):
  calls = []

  def read():
    calls.append(time.monotonic())
    if len(calls) <= times:
      raise error
    return value
  return read, calls


@settings(max_examples=20, deadline=None)
@given(failures=st.integers(0, 6))
def test_transient_failures_are_retried_and_counted(failures):
  read, calls = _failing(failures, OSError(S3_503))
  with element_scope() as spent:
    assert FAST.call("s3://b/a.png", read) == "bytes"
  assert len(calls) == failures + 1 and spent.retries == failures


def test_a_definite_answer_is_raised_at_once():
  read, calls = _failing(5, FileNotFoundError(2, "no such object"))
  with pytest.raises(FileNotFoundError):
    FAST.call("s3://b/a.png", read)
  assert len(calls) == 1


def test_past_the_deadline_the_error_names_the_object_the_error_and_the_time():
  read, calls = _failing(10**6, OSError(S3_REFUSED))
  policy = RetryPolicy(timeout_s=0.2, first_wait_s=0.01, longest_wait_s=0.05)
  with pytest.raises(StorageUnavailableError) as e:
    policy.call("s3://b/a.png", read)
  message = str(e.value)
  assert "s3://b/a.png" in message and "NETWORK_CONNECTION" in message
  assert e.value.waited_s >= 0.2 and e.value.attempts == len(calls) > 1
  assert calls[-1] - calls[0] < 0.2 + 1.0  # stopped near the deadline, not long after


def test_the_reads_of_one_element_share_its_deadline():
  policy = RetryPolicy(timeout_s=0.05, first_wait_s=0.0, longest_wait_s=0.0)
  slow = lambda: time.sleep(0.1) or "slow but fine"
  read, calls = _failing(1, OSError(S3_503))
  with element_scope():
    assert policy.call("record", slow) == "slow but fine"
    with pytest.raises(StorageUnavailableError):
      policy.call("its image", read)  # the element's deadline has passed: no retry
  assert len(calls) == 1


def test_each_attempt_runs_under_the_elements_deadline():
  from bagel_grain.remote import http  # pylint: disable=import-outside-toplevel
  seen = []
  with element_scope():
    start = time.monotonic()
    FAST.call("image", lambda: seen.append(http.current_deadline()))
  assert seen[0] is not None and start <= seen[0] <= start + FAST.timeout_s + 0.01
  assert http.current_deadline() is None  # nothing left behind


def test_once_the_element_is_abandoned_a_failure_is_not_tried_again():
  read, calls = _failing(5, OSError(S3_503))
  abandoned = threading.Event()
  abandoned.set()  # the fetcher was closed while this element was computed
  with element_scope(abandoned), pytest.raises(OSError):
    RetryPolicy(timeout_s=60).call("image", read)
  assert len(calls) == 1


def test_a_read_ahead_thread_tries_once():
  read, calls = _failing(1, OSError(S3_503))
  errors = []

  def ahead():
    storage.single_attempts()
    try:
      FAST.call("ahead", read)
    except OSError as e:
      errors.append(e)

  thread = threading.Thread(target=ahead)
  thread.start()
  thread.join()
  assert len(calls) == 1 and is_transient(errors[0])  # left to the consumer


def test_one_log_line_when_storage_fails_and_one_when_it_is_back(caplog, monkeypatch):
  monkeypatch.setattr(storage, "OUTAGE", storage._Outage())  # pylint: disable=protected-access
  with caplog.at_level(logging.WARNING, logger="bagel_grain.storage"):
    for _ in range(2):  # two outages, each of five failed attempts
      read, _ = _failing(5, OSError(S3_503))
      FAST.call("s3://b/a.png", read)
  messages = [r.getMessage() for r in caplog.records]
  assert [m.split(" (")[0].split(" after")[0] for m in messages] == [
      "storage is failing", "storage is back"] * 2
  assert "s3://b/a.png" in messages[0] and "HTTP status 503" in messages[0]
  assert "5 failed attempts" in messages[1]


def test_policy_for_keeps_the_storage_deadline_below_the_element_timeout():
  assert storage.policy_for(120, 300).timeout_s == 120
  assert storage.policy_for(120, 20).timeout_s == pytest.approx(16)


def test_the_storage_error_crosses_processes_as_itself():
  import pickle  # pylint: disable=import-outside-toplevel
  error = StorageUnavailableError("gs://b/x", "OSError: reset", 12.5, 7)
  again = pickle.loads(pickle.dumps(error))
  assert type(again) is StorageUnavailableError and str(again) == str(error)


def test_a_storage_read_outside_any_element_is_retried_under_the_builds_policy():
  # A build's listing or footer read: waited out like a stream's, to the build's deadline.
  failures = iter([ConnectionResetError(), OSError(S3_503)])

  def read():
    error = next(failures, None)
    if error is not None:
      raise error
    return b"footer"

  with storage.build_scope(FAST):
    assert storage.retried("s3://b/part-0.parquet", read) == b"footer"
  with storage.build_scope(RetryPolicy(timeout_s=0.05, first_wait_s=0.01)):
    with pytest.raises(StorageUnavailableError, match="reading s3://b/part-0.parquet"):
      storage.retried("s3://b/part-0.parquet", lambda: (_ for _ in ()).throw(TimeoutError()))


def test_a_storage_read_inside_a_policys_call_or_an_element_is_tried_once():
  # The enclosing loop (a record's, a file's) tries the whole read again: no retries inside it.
  calls = []

  def read():
    calls.append(1)
    raise ConnectionResetError()

  with pytest.raises(StorageUnavailableError):  # the outer deadline passed: no second try
    RetryPolicy(timeout_s=0.0).call("x", lambda: storage.retried("x", read))
  with element_scope(), pytest.raises(ConnectionResetError):
    storage.retried("x", read)
  assert len(calls) == 2
