"""The lossless check: per prompt against the baseline's first output, first differing position."""

from __future__ import annotations

from aerie.bench.lossless import check_lossless, first_difference


def cell(variant, round_, concurrency, outputs, errors=None):
    return {"variant": variant, "round": round_, "concurrency": concurrency,
            "requests": [{"prompt": p, "token_ids": ids, "error": (errors or {}).get(p)} for p, ids in outputs]}


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2
    assert first_difference([1], [1, 2]) == 1


def test_a_variant_with_any_differing_output_fails_and_says_where():
    cells = [
        cell("none", 0, 1, [(0, [1, 2, 3]), (1, [4, 5])]),
        cell("none", 1, 4, [(0, [1, 2, 3]), (1, [4, 5])]),
        cell("eagle3 K=3", 0, 1, [(0, [1, 2, 3]), (1, [4, 5])]),
        cell("peagle K=3", 0, 1, [(0, [1, 2, 3]), (1, [4, 5])]),
        cell("peagle K=3", 1, 4, [(0, [1, 2, 3]), (1, [4, 6, 7])]),
        cell("ngram K=4", 0, 1, [(0, [1, 2, 3]), (1, [])], errors={1: "RuntimeError: boom"}),
    ]
    verdicts = check_lossless(cells, "none")
    assert verdicts["none"].lossless and verdicts["eagle3 K=3"].lossless and verdicts["eagle3 K=3"].checked == 2
    bad = verdicts["peagle K=3"]
    assert not bad.lossless and bad.mismatched_prompts == [1]
    assert (bad.mismatches[0].round, bad.mismatches[0].concurrency, bad.mismatches[0].position) == (1, 4, 1)
    assert (bad.mismatches[0].expected, bad.mismatches[0].got) == (5, 6)
    assert "NOT LOSSLESS" in bad.summary() and "token 1 is 6, the baseline's is 5" in bad.summary()
    failed = verdicts["ngram K=4"]
    assert not failed.lossless and failed.failed_requests == 1 and "boom" in failed.mismatches[0].error


def test_a_baseline_that_disagrees_with_itself_is_flagged():
    cells = [cell("none", 0, 1, [(0, [1, 2])]), cell("none", 0, 8, [(0, [1, 3])])]
    assert not check_lossless(cells, "none")["none"].lossless
