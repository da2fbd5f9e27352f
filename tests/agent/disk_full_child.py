"""A process that emits durable records (the recorder's path: ring, then spool) into a spool on a full or
tiny filesystem, then prints its agent's counts: it must live to print them."""

from __future__ import annotations

import json
import sys

from ddpscope import agent


def main(spool_dir: str, url: str, count: int) -> None:
    agent.configure(job="disk-full", rank=0, spool_dir=spool_dir, url=url)
    for i in range(count):
        agent.emit_durable(
            {"kind": "heartbeat", "rank": 0, "phase": "forward", "step": i, "last_coll_seq": i, "pid": 1}
        )
    live = agent.get_agent()
    live.flush_local(5.0)
    print(json.dumps(live.stats()), flush=True)
    live.force_flush(10.0)
    live.shutdown(2.0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
