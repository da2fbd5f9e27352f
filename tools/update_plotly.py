"""Vendor another release of plotly's cartesian bundle: ``python tools/update_plotly.py VERSION``.

Downloads ``plotly.js-cartesian-dist-min@VERSION`` from the npm registry, checks the tarball against
the ``integrity`` hash npm publishes for it, writes ``plotly-cartesian.min.js`` and its LICENSE into
``dashboard/static/vendor/`` unchanged, and prints the SHA-256 to pin in ``dashboard/plotly_js.py``.
Standard library only.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import sys
import tarfile
import urllib.request
from pathlib import Path

PACKAGE = "plotly.js-cartesian-dist-min"
REGISTRY = "https://registry.npmjs.org"
VENDOR = Path(__file__).resolve().parent.parent / "dashboard" / "static" / "vendor"
FILES = {"package/plotly-cartesian.min.js": "plotly-cartesian.min.js", "package/LICENSE": "plotly-LICENSE"}


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as resp:  # noqa: S310 - a fixed https registry URL
        return bytes(resp.read())


def main(version: str) -> None:
    meta = json.loads(fetch(f"{REGISTRY}/{PACKAGE}/{version}"))
    tarball = fetch(meta["dist"]["tarball"])
    algorithm, _, expected = meta["dist"]["integrity"].partition("-")
    actual = base64.b64encode(hashlib.new(algorithm, tarball).digest()).decode()
    if actual != expected:
        sys.exit(
            f"{PACKAGE}@{version}: the tarball's {algorithm} is {actual}, npm says {expected}; not vendored"
        )
    with tarfile.open(fileobj=io.BytesIO(tarball)) as tar:
        for member, name in FILES.items():
            extracted = tar.extractfile(member)
            if extracted is None:
                sys.exit(f"{PACKAGE}@{version} has no {member}; not vendored")
            (VENDOR / name).write_bytes(extracted.read())
    digest = hashlib.sha256((VENDOR / FILES["package/plotly-cartesian.min.js"]).read_bytes()).hexdigest()
    print(f"vendored {PACKAGE}@{version}; set VENDORED_SHA256 = {digest!r} in dashboard/plotly_js.py")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/update_plotly.py VERSION   (for example 4.1.1)")
    main(sys.argv[1])
