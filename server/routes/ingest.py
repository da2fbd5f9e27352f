"""``POST /api/v1/ingest``: a batch of wire records, stored whole or not at all.

Order of checks, cheapest first: token (401), admission (429), size as sent (413), gzip and size
after decompression (413/400), JSON and every record against the wire format (400/422 naming the
field), then one transaction. The response (200) is sent only after the commit.
"""

from __future__ import annotations

import hmac
import logging

import anyio.to_thread
from fastapi import APIRouter, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.exc import DBAPIError

from ddpscope.server.body import BadEncoding, BodyTooLarge, decode_content, read_limited
from ddpscope.server.codec import BatchError, decode_batch
from ddpscope.server.deps import SettingsDep, StorageDep
from ddpscope.server.gate import IngestGate
from ddpscope.server.storage import Storage

logger = logging.getLogger(__name__)

router = APIRouter(tags=["ingest"])


def _authorized(request: Request, token: str) -> bool:
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # Constant time: the comparison must not reveal how many leading characters matched.
    return hmac.compare_digest(given.strip().encode(), token.encode())


def _store(storage: Storage, body: bytes, encoding: str | None, limit: int) -> dict[str, int]:
    records = decode_batch(decode_content(body, encoding, limit))
    result = storage.write_batch(records)
    return {"accepted": result.accepted, "duplicates": result.duplicates}


async def _reject(storage: Storage, reason: str, status: int, message: str) -> HTTPException:
    await run_in_threadpool(storage.count, f"rejected_batches:{reason}")
    return HTTPException(status, message)


@router.post("/api/v1/ingest")
async def ingest(request: Request, storage: StorageDep, settings: SettingsDep) -> dict[str, int]:
    """Store a batch ``{"schema": 1, "records": [...]}`` (JSON, optionally gzip)."""
    if settings.token is not None and not _authorized(request, settings.token):
        raise await _reject(
            storage,
            "unauthorized",
            401,
            "missing or wrong bearer token: send 'Authorization: Bearer <token>' (DDPSCOPE_TOKEN)",
        )
    problem = storage.engines.file_problem()
    if problem is not None:
        raise HTTPException(503, problem, headers={"Retry-After": str(settings.retry_after_s)})
    gate: IngestGate = request.app.state.ingest_gate
    if not gate.try_enter():
        storage.defer_count("rejected_batches:overloaded")
        raise HTTPException(
            429,
            f"collector busy: {gate.limit} ingest requests in progress; retry after {settings.retry_after_s} s",
            headers={"Retry-After": str(settings.retry_after_s)},
        )
    try:
        body = await read_limited(
            request.stream(), request.headers.get("content-length"), settings.max_body_bytes
        )
        encoding = request.headers.get("content-encoding")
        return await anyio.to_thread.run_sync(
            _store, storage, body, encoding, settings.max_decompressed_bytes, limiter=gate.workers
        )
    except BodyTooLarge as e:
        raise await _reject(storage, "too_large", 413, e.message) from None
    except BadEncoding as e:
        raise await _reject(storage, "bad_encoding", 400, e.message) from None
    except BatchError as e:
        status = 400 if str(e).startswith("body is not valid JSON") else 422
        raise await _reject(storage, "invalid", status, str(e)) from None
    except (DBAPIError, OSError) as e:
        # Nothing of the batch is stored (one transaction); the agent keeps it and retries.
        why = storage.write_failure[1] if storage.write_failure else type(e).__name__
        logger.warning("ingest: the database refused a batch: %s", why)
        raise HTTPException(
            503,
            f"the collector cannot write its database ({why}); nothing of this batch was stored: retry later",
            headers={"Retry-After": str(settings.retry_after_s)},
        ) from None
    finally:
        gate.leave()
