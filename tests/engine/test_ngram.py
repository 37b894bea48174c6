"""Prompt lookup's choice of draft: the continuation of the first occurrence of the longest suffix."""

from __future__ import annotations

import torch

from aerie.engine.ngram import NgramProposer


def proposer(max_n: int = 3) -> NgramProposer:
    return NgramProposer(k=4, slots=1, device=torch.device("cpu"), min_n=1, max_n=max_n)


def test_the_first_occurrence_is_drafted_not_a_later_one():
    ids = [5, 1, 2, 3, 9, 1, 7, 7, 1]
    assert proposer().lookup(0, ids, 4) == [2, 3, 9, 1]


def test_the_longest_matching_suffix_wins():
    ids = [1, 8, 8, 4, 2, 1, 6, 6, 4, 2, 1]  # "4 2 1" occurs once before; "1" first at the start
    assert proposer().lookup(0, ids, 4) == [6, 6, 4, 2]
    assert proposer(max_n=1).lookup(0, ids, 4) == [8, 8, 4, 2]


def test_no_match_drafts_nothing_and_the_index_grows_with_the_sequence():
    p = proposer()
    assert p.lookup(0, [1, 2, 3], 4) == []
    assert p.lookup(0, [1, 2, 3, 1], 4) == [2, 3, 1]  # only what the sequence holds so far
    assert p.lookup(0, [1, 2, 3, 1, 2, 5, 3], 4) == [1, 2, 5, 3]  # the first "3", not the suffix itself
