"""results.json / results.parquet, report.md and the plots from hand-made rows."""

from __future__ import annotations

import json

import matplotlib.image as mpimg
import pyarrow.parquet as pq

from aerie.bench.config import WinnerPolicy
from aerie.bench.lossless import Mismatch, Verdict
from aerie.bench.plots import PLOTS, render_plots
from aerie.bench.report import render_report
from aerie.bench.results import write_results
from aerie.bench.selection import choose_winner


def row(variant, method, k, c, tput, lossless=True, rates=(), spread=0.1):
    spec = bool(rates)
    return {"variant": variant, "method": method, "k": k, "tree": False, "head": "h" if spec else None, "lookup": False,
            "max_concurrency": c, "lossless": lossless, "output_throughput": tput, "speedup": None,
            "output_throughput_repeats": [tput * 0.95, tput, tput * 1.05], "output_throughput_spread": spread,
            "output_throughput_per_request": tput / c, "request_throughput": tput / 64, "median_ttft_ms": 10.0 * c,
            "p99_ttft_ms": 20.0 * c, "median_tpot_ms": 1000 / tput * c, "p99_tpot_ms": 2000 / tput * c,
            "median_itl_ms": 3.0, "p99_itl_ms": 6.0, "median_e2el_ms": 300.0,
            "spec_decode_num_drafts": 100 if spec else None,
            "spec_decode_acceptance_length": 1 + sum(rates) if spec else None,
            "spec_decode_acceptance_rate": sum(rates) / len(rates) if spec else None,
            "spec_decode_per_position_acceptance_rates": list(rates),
            "tokens_per_step": 1 + sum(rates) if spec else None,
            "k_histogram": {k: 100} if spec and k != "auto" else ({0: 60, 3: 40} if spec else {}),
            "wall_seconds": [1.0, 1.1, 0.9]}


def rows() -> list[dict]:
    out = []
    for c, scale in ((1, 1.0), (4, 3.0)):
        out += [row("none", "none", 0, c, 100 * scale), row("eagle3 K=3", "eagle3", 3, c, 160 * scale,
                                                             rates=(0.7, 0.5, 0.3)),
                row("peagle K=3", "peagle", 3, c, 200 * scale, lossless=False, rates=(0.9, 0.8, 0.7)),
                row("eagle3 K=auto", "eagle3", "auto", c, 150 * scale, rates=(0.7, 0.5, 0.3))]
    out += [row("hf_greedy", "hf_greedy", 0, 1, 60.0), row("hf_prompt_lookup", "hf_prompt_lookup", 0, 1, 80.0)]
    for r in out:
        base = next(b for b in out if b["variant"] == "none" and b["max_concurrency"] == r["max_concurrency"])
        r["speedup"] = r["output_throughput"] / base["output_throughput"]
    return out


def verdicts() -> dict[str, Verdict]:
    ok = {v: Verdict(v, True, checked=12) for v in ("none", "eagle3 K=3", "eagle3 K=auto", "hf_greedy",
                                                     "hf_prompt_lookup")}
    bad = Verdict("peagle K=3", False, checked=12, mismatched_prompts=[2, 5],
                  mismatches=[Mismatch(2, 0, 1, 7, 11, 12)])
    return ok | {"peagle K=3": bad}


def test_results_round_trip_through_json_and_parquet(tmp_path):
    data = rows()
    paths = write_results(data, str(tmp_path))
    assert json.loads((tmp_path / "results.json").read_text())[1]["k"] == 3
    table = pq.read_table(paths["results.parquet"])
    assert table.num_rows == len(data)
    assert table.column("k").to_pylist()[3] == "auto"
    assert dict(table.column("k_histogram").to_pylist()[3]) == {0: 60, 3: 40}


def test_the_report_leads_with_lossless_failures_then_the_winner_and_every_table():
    data = rows()
    winner = choose_winner(data, WinnerPolicy(expected_concurrency=4), target="t", report="report.md")
    facts = {"target": "t", "variants": 6, "repeats": 3, "cells": 26, "wall_seconds": 61.0, "startup_seconds": 9.0,
             "measuring_seconds": 40.0, "prompts": 8, "prompt_source": "data", "requests": 16, "warmup": 2,
             "max_tokens": 64, "device": "cpu", "builds": [{"variant": "none", "build_seconds": 1.5}]}
    text = render_report(data, verdicts(), winner, facts)
    assert text.index("LOSSLESS CHECK FAILED") < text.index("## Winner") < text.index("## Speedup")
    assert "prompt 2, round 0, concurrency 1: first difference at token 7: got 12, baseline 11" in text
    assert "**eagle3 K=3**" in text and "c=1: 3, c=4: 3" in text
    assert "| eagle3 K=3 | 1.60x | 1.60x |" in text and "| peagle K=3 ✗ | 2.00x | 2.00x |" in text
    assert "| eagle3 K=3 | 1 | 2.50 | 0.500 | 0.70 0.50 0.30 |" in text
    assert "| eagle3 K=auto | 1 |" in text and "0: 60, 3: 40" in text
    assert "is 2.67x hf_greedy" in text and "is 2.00x hf_prompt_lookup" in text
    assert "160.0 ±5%" in text


def test_every_plot_is_a_png_of_its_own(tmp_path):
    images = render_plots(rows(), "tiny")
    assert set(images) == set(PLOTS)
    for name, png in images.items():
        assert png.startswith(b"\x89PNG"), name
        (tmp_path / name).write_bytes(png)
        height, width, _ = mpimg.imread(tmp_path / name).shape
        assert width > 600 and height > 400
    assert len({hash(png) for png in images.values()}) == len(images)
