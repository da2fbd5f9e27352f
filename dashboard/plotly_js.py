"""plotly.js as the collector serves it: the installed ``plotly`` package's bundle, made cheap to load.

plotly.min.js is 4.8 MB, and on a first visit most of a page's time goes to Chromium compiling it.
Three things cut that, none of which changes a byte of plotly's own code:

- **Compile hint.** One comment line, ``//# allFunctionsCalledOnLoad``, is put in front of the bundle.
  V8 (Chrome 136 and later) then compiles every function of the file eagerly *on the streaming
  thread* while the file downloads, instead of lazily on the main thread the first time each one
  runs; plotly calls most of its functions while it registers its trace types, so the main thread's
  share of loading it dropped from about 1.0 s to 0.65 s of CPU here. Other engines ignore a comment.
- **Versioned URL, cached for good.** The URL carries a hash of the bytes served, so the response is
  ``immutable`` for a year and every page after the first takes plotly from the browser's cache (and
  V8's code cache) without a request. An ``ETag`` answers a revalidation with a 304.
- **gzip, compressed once.** 4.8 MB become 1.5 MB. Compressing takes about 0.3 s of CPU, so it is done
  once, on a background thread started with the collector (``start_precompressing``); requests that
  arrive before it is done get the uncompressed bytes rather than waiting.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.resources
import logging
import threading
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

logger = logging.getLogger(__name__)

PATH = "/static/plotly.min.js"
"""Where the collector serves plotly.js; pages load it as ``url()``, i.e. with ``?v=<hash>``."""

COMPILE_HINT = b"//# allFunctionsCalledOnLoad\n"
"""V8's explicit compile hint for a whole file (https://v8.dev/blog/explicit-compile-hints)."""

CACHE_CONTROL = "public, max-age=31536000, immutable"
CONTENT_TYPE = "text/javascript; charset=utf-8"


@dataclass(frozen=True, slots=True)
class Bundle:
    body: bytes
    """What is served: the compile hint, then the package's plotly.min.js unchanged."""
    etag: str
    """A strong validator: a quoted hash of ``body``."""
    version: str
    """The same hash, short, for the URL's ``?v=``: a new plotly package gives a new URL."""


@functools.cache
def bundle() -> Bundle:
    """The served bytes and their hash (read once, kept in memory)."""
    raw = (importlib.resources.files("plotly") / "package_data" / "plotly.min.js").read_bytes()
    body = COMPILE_HINT + raw
    digest = hashlib.sha256(body).hexdigest()
    return Bundle(body=body, etag=f'"{digest[:32]}"', version=digest[:12])


def url() -> str:
    """The versioned URL pages put in their ``<script src>``."""
    return f"{PATH}?v={bundle().version}"


_gzipped: bytes | None = None
_gzip_lock = threading.Lock()


def _compress() -> None:
    global _gzipped
    with _gzip_lock:
        if _gzipped is None:
            # mtime=0: the same bytes on every collector, so a shared cache never sees two variants.
            _gzipped = gzip.compress(bundle().body, compresslevel=9, mtime=0)
            logger.debug("plotly.js gzipped once: %d -> %d bytes", len(bundle().body), len(_gzipped))


def start_precompressing() -> threading.Thread:
    """Compress the bundle on a daemon thread (called at collector start-up); return the thread."""
    thread = threading.Thread(target=_compress, name="ddpscope-plotly-gzip", daemon=True)
    thread.start()
    return thread


def gzipped() -> bytes | None:
    """The gzip-compressed bundle, or None while it is still being compressed."""
    return _gzipped


def _accepts_gzip(request: Request) -> bool:
    for part in request.headers.get("accept-encoding", "").split(","):
        coding, _, params = part.strip().partition(";")
        if coding.strip().lower() in ("gzip", "*") and params.replace(" ", "") not in ("q=0", "q=0.0"):
            return True
    return False


def _etag_matches(request: Request, etag: str) -> bool:
    candidates = [c.strip() for c in request.headers.get("if-none-match", "").split(",")]
    # Weak comparison, as If-None-Match asks: a proxy may have turned our strong tag into W/"...".
    return "*" in candidates or any(c.removeprefix("W/") == etag for c in candidates)


def response(request: Request) -> Response:
    """plotly.js for ``request``: 304 when the browser holds this version, gzip when it accepts it."""
    b = bundle()
    headers = {"Cache-Control": CACHE_CONTROL, "ETag": b.etag, "Vary": "Accept-Encoding"}
    if _etag_matches(request, b.etag):
        return Response(status_code=304, headers=headers)
    compressed = gzipped() if _accepts_gzip(request) else None
    if compressed is None:
        return Response(b.body, media_type=CONTENT_TYPE, headers=headers)
    return Response(compressed, media_type=CONTENT_TYPE, headers={**headers, "Content-Encoding": "gzip"})
