"""A ``file://`` rendezvous left by an earlier run (``analysis/store_file.py``): the error of a rank whose
connection to a peer address read there was refused names the file, when it was written before the
rank's process started. Records shaped as torch 2.13 on gloo wrote them when a run that ended in
``os._exit`` (no ``destroy_process_group``) left its file and the next run used the same path."""

from __future__ import annotations

from typing import Any

from ddpscope.server.analysis.incidents import diagnose
from tests.server.test_incidents import T0, JobRecords, only

REFUSED = (
    "Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] "
    "timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:4499$1"
)


def failed_init(message: str, written_before_start_s: float) -> str:
    """Rank 1's init_process_group failed with ``message``; its file was last written that long before its
    process started. The rank_error incident's message."""
    job = JobRecords(2)
    for t in (T0 - 2, T0, T0 + 2):  # rank 0 waits in the group's construction for rank 1 to connect
        job.heartbeat(0, t, phase="idle")
    started_ns = int((T0 - 3) * 1e9)
    found: dict[str, Any] = {"path": "/shared/rdv", "mtime_ns": started_ns - int(written_before_start_s * 1e9),
                             "process_started_ns": started_ns}  # fmt: skip
    job.add("rank_error", 1, T0, step=None, phase="idle", error_type="RuntimeError", message=message,
            stack=message, fatal=False, store_file=found)  # fmt: skip
    # The same exception, uncaught, said again by the agent's last-resort hook (without the file).
    job.add("rank_error", 1, T0 + 0.1, step=None, phase="unknown", error_type="RuntimeError", message=message,
            stack=message, fatal=True)  # fmt: skip
    job.exit(1, T0 + 0.2, reason="error", step=None)
    return only(diagnose(job.snapshot(), T0 + 5), "rank_error").message


def test_a_refused_peer_address_read_from_a_file_written_before_the_run_names_the_leftover_file() -> None:
    message = failed_init(REFUSED, written_before_start_s=180)
    assert (
        "the cause is the rendezvous file: rank 1 called init_process_group with init_method file:///shared/rdv, "
        "a file last written at " in message
    )
    assert (
        "3 min before its process started, and the peer address it read there (127.0.0.1:4499) refused"
        in message
    )
    assert "Delete the file before each launch, or give each run a path of its own" in message
    assert "no rank reported a cause" not in message


def test_a_file_a_peer_of_this_run_wrote_first_or_an_error_that_is_no_refusal_is_not_blamed_on_the_file() -> (
    None
):
    assert "rendezvous file" not in failed_init(REFUSED, written_before_start_s=0.2)  # written as it started
    assert "rendezvous file" not in failed_init(
        "Timed out waiting 5000ms for recv", written_before_start_s=180
    )
