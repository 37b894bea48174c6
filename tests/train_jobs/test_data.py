"""Data helpers of the training job (no Ray): row selection, batching, step planning, eval reads."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from aerie.heads.fit import Example, mask_token_from_counts
from train_jobs.config import load_config
from train_jobs.data import (
    batched,
    count_batches,
    count_tokens,
    examples_from_table,
    read_eval_examples,
    select_rows,
)
from train_jobs.fit_heads import plan_steps


def table(rows):
    return pa.table(
        {
            "input_ids": pa.array([r[0] for r in rows], type=pa.list_(pa.int32())),
            "loss_mask": pa.array([r[1] for r in rows], type=pa.list_(pa.int8())),
            "has_reply": pa.array([r[2] for r in rows], type=pa.bool_()),
        }
    )


def test_select_rows_keeps_trainable_rows_only():
    t = table(
        [
            ([5, 6, 7, 8], [0, 0, 1, 1], True),  # kept
            ([5, 6, 7, 8], [0, 0, 0, 0], True),  # no loss token
            ([5, 6, 7, 8], [0, 0, 1, 1], False),  # input-only
            ([5, 6], [0, 1], True),  # too short for the head frame
            ([9, 9, 9], [1, 1, 1], True),  # kept
        ]
    )
    kept = select_rows(t)
    assert kept.column_names == ["input_ids", "loss_mask"]
    examples = examples_from_table(kept)
    assert [e.input_ids for e in examples] == [[5, 6, 7, 8], [9, 9, 9]]
    assert examples[0].loss_mask == [False, False, True, True]
    counts = count_tokens(kept, vocab_size=12)
    assert counts.column("counts")[0].as_py()[7:10] == [1, 1, 3]  # reply tokens only
    assert counts.column("lengths")[0].as_py() == [4, 3]
    assert sum(counts.column("all_counts")[0].as_py()) == 7


@pytest.mark.parametrize("budget", [None, 20, 64])
def test_count_batches_matches_batched(budget):
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 30, size=57)
    examples = [Example(list(range(n)), [True] * n) for n in lengths]
    made = list(batched(examples, 4, budget, max_length=24))
    assert count_batches(lengths, 4, budget, 24) == len(made)
    assert sum(len(b) for b in made) == len(examples)
    if budget:
        assert all(len(b) == 1 or len(b) * max(min(len(e.input_ids), 24) for e in b) <= budget for b in made)


def test_plan_steps():
    cfg = load_config(data="d", target="t", method="eagle3", out="o", workers=2, batch_size=4, epochs=3)
    assert plan_steps(cfg, np.full(121, 10))["steps_per_epoch"] == 15  # 60 rows per worker
    assert plan_steps(cfg.model_copy(update={"max_steps": 7}), np.full(121, 10))["total_steps"] == 7
    with pytest.raises(ValueError, match="cannot feed"):
        plan_steps(cfg, np.full(1, 10))


def test_mask_token_from_counts():
    counts = np.array([3, 0, 5, 1, 1])
    assert mask_token_from_counts(1, counts) == 1  # unused: kept
    assert mask_token_from_counts(2, counts) == 1  # used: the least used, highest id among ties
    assert mask_token_from_counts(2, np.array([3, 2, 5, 1, 1])) == 4


def test_read_eval_examples_in_file_order(tmp_path):
    import pyarrow.parquet as pq

    (tmp_path / "eval").mkdir()
    pq.write_table(table([([1, 2, 3], [0, 1, 1], True)] * 3), tmp_path / "eval" / "part-1.parquet")
    pq.write_table(table([([4, 5, 6], [0, 1, 1], True), ([4, 5, 6], [0, 0, 0], False)]),
                   tmp_path / "eval" / "part-0.parquet")
    got = read_eval_examples(str(tmp_path), limit=3)
    assert [e.input_ids[0] for e in got] == [4, 1, 1]
    assert read_eval_examples(str(tmp_path / "nowhere"), limit=3) == []
