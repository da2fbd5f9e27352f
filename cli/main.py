"""The ``ddpscope`` command: serve, demo, report, export, jobs. Each side is imported lazily so the
slim training install (no server extras) and the collector (no torch) both start."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: ddpscope {serve,demo,report,export,jobs} ...")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from ddpscope.server.serve import main as serve_main

        return serve_main(rest)
    print(f"ddpscope: unknown command {command!r}; expected serve, demo, report, export or jobs", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
