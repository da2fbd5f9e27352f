"""The ``ddpscope`` command: serve, demo, report, export, jobs.

Each side is imported lazily so the slim training install (no server extras) and the collector (no
torch) both start. Exit codes: 0 ok (report: nothing wrong found), 1 report found problems,
2 usage error, 3 collector unreachable or refused (or the URL is no collector), 4 unknown job,
141 (128 + SIGPIPE, as a Unix tool killed by it) the reader of the output went away.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys

from ddpscope.cli.client import Client, CollectorError, url_problem

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_COLLECTOR, EXIT_UNKNOWN_JOB = 0, 1, 2, 3, 4
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddpscope", description="Observability for PyTorch DDP jobs.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help="collector base URL (default: DDPSCOPE_URL or http://127.0.0.1:8321)")
    common.add_argument("--token", help="bearer token (default: DDPSCOPE_TOKEN)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the collector (see `ddpscope serve --help`)", add_help=False)
    demo = sub.add_parser("demo", parents=[common], help="run real gloo DDP jobs that show each diagnosis")
    from ddpscope.cli.demo import SCENARIOS

    demo.add_argument("--scenario", choices=(*SCENARIOS, "all"), default="all")
    demo.add_argument(
        "--ranks",
        type=int,
        default=4,
        help="processes per job (default 4: with 2 ranks 'the median of the others' is one rank, "
        "so any steady asymmetry between two cores reads as a straggler)",
    )
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--exit", action="store_true", help="exit after the jobs instead of serving on")
    demo.add_argument("--db", help="database for a collector the demo starts (default ./ddpscope-demo.db)")
    report = sub.add_parser("report", parents=[common], help="print a job's diagnosis")
    report.add_argument("job")
    export = sub.add_parser("export", parents=[common], help="write a job's Perfetto trace")
    export.add_argument("job")
    export.add_argument(
        "-o", "--output", required=True, help="trace file to write (open in ui.perfetto.dev); - for stdout"
    )
    export.add_argument("--start", type=int, help="first step")
    export.add_argument("--end", type=int, help="last step")
    jobs = sub.add_parser("jobs", parents=[common], help="list jobs")
    jobs.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _export(client: Client, args: argparse.Namespace) -> int:
    """``ddpscope export``: what cannot work is said before the download, and a file that cannot be
    written after it is one line, not a traceback."""
    if args.start is not None and args.end is not None and args.start > args.end:
        print(f"ddpscope export: --start {args.start} is after --end {args.end}", file=sys.stderr)
        return EXIT_USAGE
    to_stdout = args.output == "-"
    folder = os.path.dirname(os.path.abspath(args.output))
    if not to_stdout and (os.path.isdir(args.output) or not os.path.isdir(folder)):
        what = "is a directory" if os.path.isdir(args.output) else f"is in {folder}, which does not exist"
        print(f"ddpscope export: -o {args.output} {what}: give a file path to write", file=sys.stderr)
        return EXIT_USAGE
    path = client.job_path(args.job, "trace")
    params = [f"{k}={v}" for k, v in (("start", args.start), ("end", args.end)) if v is not None]
    try:
        data = client.get_bytes(path + ("?" + "&".join(params) if params else ""))
    except CollectorError as e:
        if e.status != 404:
            raise
        from ddpscope.cli.report import safe, unknown_job

        print(f"ddpscope export: {safe(unknown_job(client, args.job))}", file=sys.stderr)
        return EXIT_UNKNOWN_JOB
    events = len(json.loads(data).get("traceEvents", []))
    if to_stdout:  # `-o -`: the trace on stdout, for a pipe; the summary on stderr
        sys.stdout.buffer.write(data)
    else:
        try:
            with open(args.output, "wb") as f:
                f.write(data)
        except OSError as e:
            print(f"ddpscope export: cannot write {args.output} ({e.strerror})", file=sys.stderr)
            return EXIT_USAGE
    summary = f"wrote {'stdout' if to_stdout else args.output}: {events} trace events (open it in https://ui.perfetto.dev)"
    print(summary, file=sys.stderr if to_stdout else sys.stdout)
    if not events:
        print(
            f"ddpscope export: job {args.job} has no step records"
            + (" in that range of steps" if params else "")
            + ": the trace is empty",
            file=sys.stderr,
        )
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # output that fit in the buffer meets a closed pipe only here
        return code
    except BrokenPipeError:
        # `ddpscope jobs | head -4`: the reader has what it wanted. Stop quietly, as Unix tools do,
        # and point stdout at /dev/null so the interpreter's final flush does not raise again.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        try:
            from ddpscope.server.serve import main as serve_main
        except ImportError as e:
            print(
                f"ddpscope serve needs the collector extras: pip install 'ddpscope[server]' ({e})",
                file=sys.stderr,
            )
            return EXIT_USAGE
        return serve_main(argv[1:])
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    client = Client(args.url, args.token)
    if args.command != "demo" and (problem := url_problem(client.url)):
        print(f"ddpscope {args.command}: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "demo":
            from ddpscope.cli import demo

            if args.ranks < 2:
                print("ddpscope demo: --ranks must be at least 2 (a DDP job needs peers)", file=sys.stderr)
                return EXIT_USAGE
            return demo.main(
                client, args.scenario, args.ranks, args.steps, args.exit, args.db or demo.default_db()
            )
        if args.command == "report":
            from ddpscope.cli.report import render_report

            try:
                text, problems = render_report(client, args.job)
            except LookupError as e:
                print(f"ddpscope report: {e}", file=sys.stderr)
                return EXIT_UNKNOWN_JOB
            print(text, end="")
            return EXIT_PROBLEMS if problems else EXIT_OK
        if args.command == "export":
            return _export(client, args)
        if args.command == "jobs":
            from ddpscope.cli.report import safe, when

            items = client.items("/api/v1/jobs")
            if args.json:
                print(json.dumps(items, indent=2))
                return EXIT_OK
            print(f"{'job':<32} {'status':<9} {'ranks':>5}  last seen")
            for j in items:
                print(
                    f"{safe(j['job']):<32} {safe(j['status']):<9} {j.get('world_size')!s:>5}  {when(j.get('last_seen'))}"
                )
            return EXIT_OK
    except CollectorError as e:
        from ddpscope.cli.report import safe

        print(f"ddpscope {args.command}: {safe(e)}", file=sys.stderr)
        # A 404 is raised only by a collector (client.is_collector): the job or step does not exist.
        return EXIT_UNKNOWN_JOB if e.status == 404 else EXIT_COLLECTOR
    return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
