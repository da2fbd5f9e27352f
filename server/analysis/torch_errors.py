"""What torch's own DDP errors mean, where the message alone does not say: internal assertions a user
cannot act on ("please report a bug to PyTorch") that known, reproducible usage triggers, and the
checkpoint keys a DDP wrapper prefixes with ``module.``.

Each entry was reproduced on torch 2.13 (gloo) before it went in; the advice names torch's issue.
"""

from __future__ import annotations

import re

KNOWN_ERRORS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"expect_autograd_hooks_ INTERNAL ASSERT FAILED"),
        "torch's DDP raises this internal assertion with static_graph=True when its first backward runs "
        "under no_sync() (gradient accumulation whose first micro-batches skip the all-reduce) or when one "
        "forward's outputs get several backward() calls (pytorch/pytorch#143580, #106953): run the first "
        "iteration synced (outside no_sync()), backpropagate one summed loss, or leave static_graph off",
    ),
    (
        re.compile(r"Your training graph has changed in this iteration"),
        "with static_graph=True, torch's DDP is promised that every iteration uses the same parameters, and "
        "this rank's backward used a different set at this step than in its first iterations (a data- or "
        "rank-dependent branch, a layer used only on some steps): make every iteration use the same "
        "parameters, or drop static_graph=True and pass find_unused_parameters=True",
    ),
    (
        re.compile(r"Expected to mark a variable ready only once"),
        "torch's DDP saw one parameter's gradient arrive twice in one backward. The usual cause is reentrant "
        "activation checkpointing (torch.utils.checkpoint with use_reentrant=True, under "
        "find_unused_parameters=True or over a block run twice in one forward): pass use_reentrant=False. "
        "Otherwise a parameter takes part in two backward passes of one iteration (a module called outside "
        "the DDP model's forward, or several backward() calls before the optimizer step): make each "
        "iteration one forward through the DDP model and one backward, or pass static_graph=True if the "
        "graph is the same every iteration",
    ),
    (
        re.compile(r"element 0 of tensors does not require grad and does not have a grad_fn"),
        "the loss has no autograd graph: the forward ran with autograd off (torch.no_grad() or "
        "torch.set_grad_enabled(False) still in force, say after an evaluation on this rank only, or "
        "model.eval() code that turned it off) or the loss was detached; re-enable autograd before the "
        "training forward (torch.set_grad_enabled(True), or scope the evaluation in a with torch.no_grad(): block)",
    ),
    (
        re.compile(r'Unexpected key\(s\) in state_dict: "module\.'),
        "the checkpoint was saved from the DistributedDataParallel wrapper, whose state_dict() prefixes every "
        "key with 'module.', and is loaded into the bare model: save model.module.state_dict() instead, or "
        "strip the prefix when loading (torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, "
        "'module.'))",
    ),
    (
        re.compile(r"failed to listen on any local network address.*EADDRINUSE"),
        "something on rank 0's host already listens on the rendezvous port this message names "
        "(MASTER_PORT): another job on the same node with the same port (torchrun's default is 29500), "
        "a previous run's processes still alive (ss -ltnp shows which), or another process of this job "
        "given the same RANK (a launch script's bug: the rank no process was given then never joins, and "
        "its peers wait for it in the rendezvous). Give each job a port of its own (torchrun "
        "--master-port, or --standalone on one node, which picks a free one), stop the old processes, or "
        "give each process of the job its own RANK; the other ranks may otherwise reach the other job's store",
    ),
    (
        re.compile(r"DataLoader worker \(pid\(?s?\)? ?[\d, ]+\)? is killed by signal: Killed"),
        "a DataLoader worker of this rank got SIGKILL, almost always from the kernel's OOM killer (its log on "
        "this host says 'Out of memory: Killed process' with the worker's pid). Workers are processes of their "
        "own (the rank's memory below counts theirs apart), and each one turns the pages of the Dataset's Python lists "
        "and dicts it reads into private copies (reference counts write to them): use fewer workers "
        "(num_workers), a smaller prefetch_factor, or keep the data in numpy arrays or tensors rather than "
        "Python objects",
    ),
    (
        re.compile(r"CheckpointException ranks:"),
        "torch's distributed checkpoint (torch.distributed.checkpoint) raises this on every rank when the ranks "
        "it names failed their part of "
        "the save or load (each rank writes or reads its own shard, then the ranks gather how it went): the "
        "cause is on those ranks, usually a path missing or not writable on their hosts (a checkpoint "
        "directory on a disk only some hosts mount), a full disk, or a shard missing on load",
    ),
    (
        re.compile(r"Unable to find address for: \S+"),
        "gloo binds to the network interface GLOO_SOCKET_IFNAME names (the message says which), and this host "
        "has none of that name: a setting copied from another cluster, or hosts whose interfaces are named "
        "differently (eth0, ens5, ib0). Set it on each host to an interface `ip -br addr` lists there, one that "
        "reaches the other hosts, or unset it and let gloo use the address the host name resolves to",
    ),
    (
        re.compile(r'Missing key\(s\) in state_dict: "module\.'),
        "a checkpoint of the bare model (keys without 'module.') is loaded into the DistributedDataParallel "
        "wrapper, whose keys carry that prefix: load it into model.module instead (or before wrapping)",
    ),
)


def torch_error_advice(message: str) -> str | None:
    """What a known torch error means and what to do, or None for any other message."""
    for pattern, advice in KNOWN_ERRORS:
        if pattern.search(message):
            return advice
    return None
