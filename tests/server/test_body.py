"""Body limits and gzip handling, and the settings a collector refuses to start with."""

from __future__ import annotations

import asyncio
import gzip

import pytest

from ddpscope.server.body import BadEncoding, BodyTooLarge, decode_content, read_limited
from ddpscope.server.settings import Settings, is_loopback


async def _chunks(*parts: bytes):
    for p in parts:
        yield p


def test_a_body_exactly_at_the_limit_passes_and_one_byte_more_does_not():
    data = bytes(range(256)) * 4000
    packed = gzip.compress(data)
    assert decode_content(packed, "gzip", len(data)) == data
    with pytest.raises(BodyTooLarge):
        decode_content(packed, "gzip", len(data) - 1)
    assert asyncio.run(read_limited(_chunks(b"ab", b"cd"), None, 4)) == b"abcd"
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_limited(_chunks(b"ab", b"cde"), None, 4))


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    async def never():
        raise AssertionError("the body must not be read")
        yield b""  # pragma: no cover

    with pytest.raises(BodyTooLarge, match="10 bytes exceeds the limit of 4"):
        asyncio.run(read_limited(never(), "10", 4))


def test_a_gzip_bomb_is_stopped_after_the_limit_not_after_inflating_it():
    # ~1000:1 ratio; a real bomb is the same shape, only larger.
    bomb = gzip.compress(b"\0" * 50_000_000, 9)
    inflater_limit = 1_000_000
    with pytest.raises(BodyTooLarge, match="decompressed"):
        decode_content(bomb, "gzip", inflater_limit)


def test_truncated_or_foreign_encodings_are_bad_requests():
    packed = gzip.compress(b"{}" * 1000)
    with pytest.raises(BadEncoding, match="truncated"):
        decode_content(packed[: len(packed) // 2], "gzip", 10**6)
    with pytest.raises(BadEncoding, match="not supported"):
        decode_content(b"{}", "deflate, br", 10**6)
    assert decode_content(b"{}", None, 10) == b"{}"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_hosts_need_no_token(host):
    assert is_loopback(host)
    Settings(host=host).check()


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "collector.example"])
def test_other_hosts_need_a_token_or_an_explicit_no_auth(host):
    with pytest.raises(ValueError, match="--token"):
        Settings(host=host).check()
    Settings(host=host, token="t").check()
    Settings(host=host, no_auth=True).check()


def test_an_empty_token_is_refused():
    with pytest.raises(ValueError, match="empty token"):
        Settings(token=" ").check()


def test_a_database_url_that_cannot_work_is_refused_with_the_forms_that_do():
    with pytest.raises(ValueError, match="sqlite:///"):
        Settings(db_url="ddpscope.db").check()
    with pytest.raises(ValueError, match="unsupported database 'mysql'"):
        Settings(db_url="mysql://x@y/z").check()
