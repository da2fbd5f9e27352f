"""Rank lists in words (``agent/rank_spans.py``): written by both sides, read back by the collector."""

from __future__ import annotations

from ddpscope.agent.rank_spans import MAX_PARSED_RANKS, parse_ranks, ranks_text


def test_ranks_are_listed_with_runs_of_three_or_more_as_spans() -> None:
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([2, 0]) == "ranks 0, 2"
    assert ranks_text([0, 1, 2, 3, 5, 7, 8, 9, 11, 12]) == "ranks 0-3, 5, 7-9, 11, 12"


def test_a_list_written_reads_back_as_the_same_ranks() -> None:
    for ranks in ([3], [0, 2], [0, 1, 2, 3, 5, 7, 8, 9, 11, 12], list(range(1024))):
        assert parse_ranks(ranks_text(ranks).split(" ", 1)[1]) == ranks


def test_a_forged_list_costs_little_and_what_is_not_a_rank_is_skipped() -> None:
    assert len(parse_ranks("0-999999999, 5")) == MAX_PARSED_RANKS
    assert parse_ranks("9" * 5000 + ", 3") == [3]
    assert parse_ranks("x, 4-y, 7") == [7]
