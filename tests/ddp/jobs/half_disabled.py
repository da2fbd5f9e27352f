"""One rank of a job where rank 1 runs with ``DDPSCOPE_DISABLED=1`` (its node's environment differs).

Usage: half_disabled.py ENGINE OUTDIR, ENGINE ``engine`` (ddpscope's) or ``torch`` (torch's DDP under
``instrument()``). Each rank writes OUTDIR/rank<R>.json: what its DDP construction raised (or ""), and
whether the model's parameters agree across ranks after three steps.
"""

from __future__ import annotations

import json
import os
import sys

if os.environ.get("RANK") == "1":
    os.environ["DDPSCOPE_DISABLED"] = "1"  # before ddpscope is imported, as a node's environment would

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from ddpscope.ddp import DistributedDataParallel, instrument  # noqa: E402

ENGINE, OUTDIR = sys.argv[1], sys.argv[2]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    result: dict[str, object] = {"raised": "", "equal": None}
    try:
        if ENGINE == "engine":
            model = DistributedDataParallel(module)
        else:
            model = instrument(nn.parallel.DistributedDataParallel(module))
        for _ in range(3):
            model(torch.randn(5, 4)).sum().backward()
        weight = module[0].weight.detach().clone()
        gathered = [torch.zeros_like(weight) for _ in range(2)]
        dist.all_gather(gathered, weight)
        result["equal"] = torch.equal(gathered[0], gathered[1])
    except Exception as e:  # the engine's refusal on rank 0; on rank 1, torch's lost connection after it
        result["raised"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(OUTDIR, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # rank 1's group may be broken: no destroy_process_group handshake


if __name__ == "__main__":
    main()
