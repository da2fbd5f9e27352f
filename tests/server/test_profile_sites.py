"""The line a straggler's slow phase was sampled at most (``analysis/profile_sites.py``)."""

from __future__ import annotations

from typing import Any

from ddpscope.server.analysis.profile_sites import SampledSite, sampled_site


def profile(rank: int, *sites: tuple[str, str | None, int]) -> dict[str, Any]:
    return {
        "kind": "site_profile",
        "rank": rank,
        "sites": [{"phase": p, "site": s, "n": n} for p, s, n in sites],
    }


def test_the_records_of_a_rank_add_up_and_the_line_with_most_of_the_phase_is_named() -> None:
    profiles = [
        profile(1, ("idle", "augment.py:11", 15), ("idle", "train.py:30", 3), ("forward", "model.py:9", 40)),
        profile(1, ("idle", "augment.py:11", 20), ("optimizer", "train.py:33", 2)),
        profile(0, ("idle", "train.py:30", 50)),
    ]
    assert sampled_site(profiles, 1, "between_steps") == SampledSite("augment.py:11", 35, 40)
    assert sampled_site(profiles, 1, "backward") is None  # no sample there


def test_a_phase_spread_over_many_lines_names_none() -> None:
    spread = profile(1, *(("backward", f"model.py:{i}", 3) for i in range(10)))
    assert sampled_site([spread], 1, "backward") is None
    # Outside user code all along (torch's own frames): no line either.
    assert sampled_site([profile(1, ("idle", None, 30))], 1, "between_steps") is None


def test_a_line_waiting_for_the_dataloaders_workers_is_said_to_wait_for_them() -> None:
    loop = profile(1, ("idle", "train.py:30", 25), ("idle", "train.py:30", 5))
    loop["sites"][0]["loader"] = True
    assert sampled_site([loop], 1, "between_steps") == SampledSite("train.py:30", 30, 30, loader=True)
    assert sampled_site([profile(1, ("idle", "train.py:30", 30))], 1, "between_steps") == SampledSite(
        "train.py:30", 30, 30, loader=False
    )
