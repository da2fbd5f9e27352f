"""How incidents quote what ranks reported: the line of an error message that says what went wrong."""

from __future__ import annotations

from ddpscope.server.analysis.incident_model import first_line


def test_an_error_torch_reraised_from_a_dataloader_worker_is_quoted_with_the_workers_own_error() -> None:
    message = (
        "Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        '  File "/venv/torch/utils/data/_utils/worker.py", line 374, in _worker_loop\n'
        "    data = fetcher.fetch(index)\n"
        "ValueError: corrupt record 27 in shard-1.bin\n"
    )
    assert first_line(message) == (
        "Caught ValueError in DataLoader worker process 0: ValueError: corrupt record 27 in shard-1.bin"
    )


def test_any_other_message_is_quoted_by_its_first_line() -> None:
    assert first_line("\n  Timed out after 30 s\nsecond line") == "Timed out after 30 s"
    assert first_line("Caught up with peers\nOriginal plan changed\nlast") == "Caught up with peers"
