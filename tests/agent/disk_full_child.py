"""A process that emits durable records (the recorder's path: ring, then spool) into a spool on a full or
tiny filesystem, then prints its agent's counts: it must live to print them."""

from __future__ import annotations

import json
import sys
import time

from ddpscope import agent


def main(spool_dir: str, url: str, count: int, flush_s: float) -> None:
    agent.configure(job="disk-full", rank=0, spool_dir=spool_dir, url=url)
    longest_emit_s = 0.0
    for i in range(count):
        began = time.perf_counter()
        agent.emit_durable(
            {"kind": "heartbeat", "rank": 0, "phase": "forward", "step": i, "last_coll_seq": i, "pid": 1}
        )
        longest_emit_s = max(longest_emit_s, time.perf_counter() - began)
    live = agent.get_agent()
    if not live.flush_local(5.0):  # no spool to write: the records go straight to the collector
        live.force_flush(flush_s)
    print(json.dumps({**live.stats(), "longest_emit_s": longest_emit_s}), flush=True)
    live.force_flush(flush_s)
    live.shutdown(2.0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]) if len(sys.argv) > 4 else 10.0)
