"""Reading a request body within limits, before and after gzip decompression.

The compressed size is checked against ``Content-Length`` first and then while streaming; the
decompressed size is enforced while inflating (``decompress(data, max_length)``), so a gzip bomb
costs at most the limit in memory, never its full expansion.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator


class BodyTooLarge(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadEncoding(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


async def read_limited(chunks: AsyncIterator[bytes], content_length: str | None, limit: int) -> bytes:
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise BadEncoding(f"Content-Length {content_length!r} is not a number") from None
        if declared > limit:
            raise BodyTooLarge(
                f"request body of {declared} bytes exceeds the limit of {limit} bytes; send smaller batches"
            )
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        parts.append(chunk)
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes; send smaller batches")
    return b"".join(parts)


def decode_content(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo ``Content-Encoding`` (identity or gzip) without producing more than ``limit`` bytes."""
    enc = (encoding or "identity").strip().lower()
    if enc == "identity":
        return body
    if enc not in ("gzip", "x-gzip"):
        raise BadEncoding(f"Content-Encoding {encoding!r} is not supported; use gzip or none")
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    parts: list[bytes] = []  # joined once at the end: no repeated copies of a multi-MB body
    size = 0
    data = body
    try:
        while True:
            # max_length bounds this call's output; the rest of the input waits in unconsumed_tail.
            chunk = inflater.decompress(data, limit - size + 1)
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(
                    f"decompressed body exceeds the limit of {limit} bytes; send smaller batches"
                )
            data = inflater.unconsumed_tail
            if inflater.eof or (not data and not chunk):
                break
    except zlib.error as e:
        raise BadEncoding(f"body is not valid gzip: {e}") from None
    if not inflater.eof:
        raise BadEncoding("body is not valid gzip: the stream is truncated")
    return parts[0] if len(parts) == 1 else b"".join(parts)
