"""plotly.js as the collector serves it: a vendored partial bundle, made cheap to load.

The pages draw only cartesian traces (scatter, bar, heatmap) and shapes, so the collector serves
plotly's official *cartesian* bundle (``plotly.js-cartesian-dist-min`` from npm, MIT licensed),
vendored unchanged under ``static/vendor/`` and pinned by its SHA-256 below: 1.5 MB instead of the
4.8 MB of the full bundle the ``plotly`` Python package carries. On a first visit most of a page's
time goes to Chromium compiling plotly, and the full bundle also registers maps, 3-D and WebGL
traces that no page draws; the partial one cut the cold first render (see ``bench/dashboard.py``).
``tests/browser/test_router.py`` checks that every trace type the pages use is in the bundle.
To move to another plotly.js version: ``make update-plotly PLOTLY_VERSION=x.y.z`` (it downloads the
npm tarball, checks npm's integrity hash and prints the new pin for ``VENDORED_SHA256``).

Three more things cut the load, none of which changes a byte of plotly's own code:

- **Compile hint.** One comment line, ``//# allFunctionsCalledOnLoad``, is put in front of the bundle.
  V8 (Chrome 136 and later) then compiles every function of the file eagerly *on the streaming
  thread* while the file downloads, instead of lazily on the main thread the first time each one
  runs; plotly calls most of its functions while it registers its trace types, so the main thread's
  share of loading it dropped from about 1.0 s to 0.65 s of CPU here (full bundle). Other engines
  ignore a comment.
- **Versioned URL, cached for good.** The URL carries a hash of the bytes served, so the response is
  ``immutable`` for a year and every page after the first takes plotly from the browser's cache (and
  V8's code cache) without a request. An ``ETag`` answers a revalidation with a 304.
- **gzip, compressed once.** Compressing takes CPU, so it is done once, on a background thread started
  with the collector (``start_precompressing``); requests that arrive before it is done get the
  uncompressed bytes rather than waiting.
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

VENDORED = "plotly-cartesian.min.js"
"""The bundle's file name under ``dashboard/static/vendor/`` (plotly.js-cartesian-dist-min 4.1.1)."""
VENDORED_SHA256 = "79542150855a52c567260e3137095dbe2b744e6d702a5cabe67da246942fba7a"
"""The vendored file's hash as published on npm: a test fails if the file is edited by hand."""


@dataclass(frozen=True, slots=True)
class Bundle:
    body: bytes
    """What is served: the compile hint, then the vendored bundle unchanged."""
    etag: str
    """A strong validator: a quoted hash of ``body``."""
    version: str
    """The same hash, short, for the URL's ``?v=``: a new plotly bundle gives a new URL."""


def vendored_bytes() -> bytes:
    """The vendored plotly.js file, byte for byte as npm publishes it."""
    return (importlib.resources.files("ddpscope.dashboard") / "static" / "vendor" / VENDORED).read_bytes()


@functools.cache
def bundle() -> Bundle:
    """The served bytes and their hash (read once, kept in memory)."""
    raw = vendored_bytes()
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
