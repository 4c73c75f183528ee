"""The object-store client's pieces that need no server: signing, bounded pagination."""

import datetime
import hashlib

import pytest

from bagel_grain.remote import s3
from bagel_grain.remote.objects import BadListing, FileInfo, ListingTooLong, collect_pages

EXAMPLE = s3.Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
WHEN = datetime.datetime(2013, 5, 24, tzinfo=datetime.timezone.utc)


@pytest.mark.parametrize("url, headers, signed, signature", [
    # AWS's own examples of Signature Version 4 for S3 (GET Object, and a listing).
    ("https://examplebucket.s3.amazonaws.com/test.txt", {"Range": "bytes=0-9"},
     "host;range;x-amz-content-sha256;x-amz-date",
     "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"),
    ("https://examplebucket.s3.amazonaws.com/?max-keys=2&prefix=J", {},
     "host;x-amz-content-sha256;x-amz-date",
     "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"),
])
def test_requests_are_signed_as_aws_documents(url, headers, signed, signature):
  out = s3._sign("GET", url, headers, EXAMPLE, "us-east-1", WHEN)  # pylint: disable=protected-access
  assert out["Authorization"] == (
      "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
      f"SignedHeaders={signed}, Signature={signature}")
  assert "x-amz-security-token" not in out


def test_a_session_token_is_signed_and_sent():
  creds = s3.Credentials("AKID", "secret", "session-token")
  out = s3._sign("GET", "http://127.0.0.1:9000/b/k", {}, creds, "us-east-1", WHEN)  # pylint: disable=protected-access
  assert out["x-amz-security-token"] == "session-token"
  assert "x-amz-security-token" in out["Authorization"]


def _pages(pages):
  """`fetch` for collect_pages over literal pages: {token: (names, next token)}."""
  asked = []

  def fetch(token):
    asked.append(token)
    names, following = pages[token]
    return [FileInfo(f"s3://b/{n}", "file", 1) for n in names], following
  return fetch, asked


def test_pages_are_followed_to_the_last():
  fetch, asked = _pages({None: (["a", "b"], "t1"), "t1": (["c"], "t2"), "t2": (["d"], None)})
  assert [f.base_name for f in collect_pages(fetch, "s3://b/")] == ["a", "b", "c", "d"]
  assert asked == [None, "t1", "t2"]


def test_a_token_seen_before_is_refused_not_followed():
  fetch, asked = _pages({None: (["a"], "t1"), "t1": (["b"], "t2"), "t2": (["c"], "t1")})
  with pytest.raises(BadListing, match="repeated its continuation token"):
    collect_pages(fetch, "s3://b/")
  assert asked == [None, "t1", "t2"]


def test_a_page_whose_keys_go_back_is_refused():
  fetch, _ = _pages({None: (["a", "b"], "t1"), "t1": (["a", "b"], "t2")})
  with pytest.raises(BadListing, match="went back"):
    collect_pages(fetch, "s3://b/")


def test_a_listing_past_its_bound_stops_at_the_page_that_passes_it():
  pages = {None if i == 0 else str(i): ([f"k{i:04d}{j}" for j in range(10)], str(i + 1))
           for i in range(1000)}
  fetch, asked = _pages(pages)
  with pytest.raises(ListingTooLong, match="more than 25 files"):
    collect_pages(fetch, "s3://b/", max_entries=25)
  assert len(asked) == 3


def test_a_body_is_signed_with_its_sha256_as_aws_documents():
  # AWS's example of Signature Version 4 for S3's PUT Object ("Welcome to Amazon S3.").
  body = b"Welcome to Amazon S3."
  headers = {"Date": "Fri, 24 May 2013 00:00:00 GMT", "x-amz-storage-class": "REDUCED_REDUNDANCY"}
  out = s3._sign("PUT", "https://examplebucket.s3.amazonaws.com/test%24file.text", headers,  # pylint: disable=protected-access
                 EXAMPLE, "us-east-1", WHEN, payload=hashlib.sha256(body).hexdigest())
  assert out["x-amz-content-sha256"] == (
      "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072")
  assert out["Authorization"] == (
      "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
      "SignedHeaders=date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class, "
      "Signature=98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd")
