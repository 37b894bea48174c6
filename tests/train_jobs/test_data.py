"""Data helpers of the training job (no Ray): row selection, the epoch plan, the budget, eval reads."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from aerie.data.training_rows import (
    PlanSettings,
    RowIndex,
    RowReader,
    epoch_plan,
    examples_from_table,
    plan_budget,
    scan_file,
    trainable_mask,
)
from aerie.heads.fit import mask_token_from_counts
from train_jobs.data import read_eval_examples


def table(rows):
    return pa.table(
        {
            "input_ids": pa.array([r[0] for r in rows], type=pa.list_(pa.int32())),
            "loss_mask": pa.array([r[1] for r in rows], type=pa.list_(pa.int8())),
            "has_reply": pa.array([r[2] for r in rows], type=pa.bool_()),
        }
    )


def test_scan_keeps_trainable_rows_only(tmp_path):
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    t = table(
        [
            ([5, 6, 7, 8], [0, 0, 1, 1], True),  # kept
            ([5, 6, 7, 8], [0, 0, 0, 0], True),  # no loss token
            ([5, 6, 7, 8], [0, 0, 1, 1], False),  # input-only
            ([5, 6], [0, 1], True),  # too short for the head frame
            ([9, 9, 9], [1, 1, 1], True),  # kept
        ]
    )
    assert trainable_mask(t).tolist() == [True, False, False, False, True]
    pq.write_table(t, tmp_path / "part.parquet")
    scanned = scan_file(pafs.LocalFileSystem(), str(tmp_path / "part.parquet"), vocab_size=12)
    assert scanned["positions"].tolist() == [0, 4] and scanned["ids"] == ["part.parquet:0", "part.parquet:4"]
    assert scanned["counts"][7:10].tolist() == [1, 1, 3]  # reply tokens only
    assert scanned["lengths"].tolist() == [4, 3] and scanned["all_counts"].sum() == 7
    examples = examples_from_table(t.filter(pa.array(trainable_mask(t))))
    assert [e.input_ids for e in examples] == [[5, 6, 7, 8], [9, 9, 9]]
    assert examples[0].loss_mask == [False, False, True, True]


def _index(files: int, rows: int, seed: int = 0) -> RowIndex:
    lengths = np.random.default_rng(seed).integers(3, 30, size=files * rows).astype(np.int32)
    return RowIndex(files=[f"f{i}" for i in range(files)], file_of=np.repeat(np.arange(files), rows).astype(np.int32),
                    row_in_file=np.tile(np.arange(rows), files), ids=[f"r{i}" for i in range(files * rows)],
                    lengths=lengths)


@pytest.mark.parametrize("chunk_rows,window,budget", [(3, None, None), (None, 8, None), (5, None, 64)])
def test_epoch_plan_is_a_pure_function_that_covers_each_row_once(chunk_rows, window, budget):
    index = _index(files=4, rows=30)
    settings = PlanSettings(seed=3, world_size=2, batch_size=4, batch_tokens=budget, max_length=24,
                            chunk_rows=chunk_rows, shuffle_window=window)
    plan = epoch_plan(index, 0, settings)
    assert [[b.tolist() for b in r] for r in plan] == [[b.tolist() for b in r] for r in epoch_plan(index, 0, settings)]
    assert len(plan[0]) == len(plan[1]) > 0  # every rank has the same steps
    rows = [int(x) for r in plan for b in r for x in b]
    assert len(rows) == len(set(rows)) and len(rows) > 0.8 * len(index)  # no row twice, few dropped
    other = epoch_plan(index, 1, settings)
    assert [b.tolist() for b in other[0]] != [b.tolist() for b in plan[0]]  # a new order each epoch
    if chunk_rows is None:  # whole files per rank: a rank reads only its own files
        assert not set(index.file_of[np.concatenate(plan[0])]) & set(index.file_of[np.concatenate(plan[1])])
    if budget:
        assert all(len(b) == 1 or len(b) * max(min(int(index.lengths[i]), 24) for i in b) <= budget
                   for r in plan for b in r)
    with pytest.raises(ValueError, match="cannot feed"):
        epoch_plan(_index(files=1, rows=1), 0, settings)


def test_row_reader_reads_the_same_rows_from_memory_and_from_files(tmp_path):
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    for f in range(2):
        pq.write_table(table([([f, i, i + 1, i + 2], [0, 1, 1, 1], True) for i in range(5)]),
                       tmp_path / f"part-{f}.parquet")
    files = [str(tmp_path / f"part-{f}.parquet") for f in range(2)]
    fs = pafs.LocalFileSystem()
    scans = [scan_file(fs, p, vocab_size=16) for p in files]
    from aerie.data.training_rows import build_index

    index = build_index(files, scans)
    from_files = RowReader(index, filesystem=fs, keep_files=1)
    whole = pa.concat_tables([pq.read_table(p, columns=["input_ids", "loss_mask"]) for p in files])
    in_memory = RowReader(index, whole)
    rows = np.array([7, 1, 5, 0])
    assert [e.input_ids for e in from_files.examples(rows)] == [e.input_ids for e in in_memory.examples(rows)]
    assert [e.input_ids[:2] for e in from_files.examples(rows)] == [[1, 2], [0, 1], [1, 0], [0, 0]]
    assert from_files.ids(rows) == ["part-1.parquet:2", "part-0.parquet:1", "part-1.parquet:0", "part-0.parquet:0"]


def test_budget_fixed_and_automatic():
    assert plan_budget(15, epochs=3, max_steps=None, min_steps=300, max_epochs=100, eval_every=0) == {
        "steps_per_epoch": 15, "epochs": 3, "total_steps": 45, "eval_every": 0}
    assert plan_budget(15, epochs=None, max_steps=7, min_steps=300, max_epochs=100, eval_every=None)["total_steps"] == 7
    small = plan_budget(4, epochs=None, max_steps=None, min_steps=300, max_epochs=100, eval_every=None)
    assert (small["epochs"], small["total_steps"], small["eval_every"]) == (75, 300, 15)  # small data: many passes
    large = plan_budget(5000, epochs=None, max_steps=None, min_steps=300, max_epochs=100, eval_every=None)
    assert (large["epochs"], large["total_steps"], large["eval_every"]) == (3, 15000, 750)
    capped = plan_budget(1, epochs=None, max_steps=None, min_steps=300, max_epochs=100, eval_every=None)
    assert capped["total_steps"] == 100


def test_mask_token_from_counts():
    counts = np.array([3, 0, 5, 1, 1])
    assert mask_token_from_counts(1, counts) == 1  # unused: kept
    assert mask_token_from_counts(2, counts) == 1  # used: the least used, highest id among ties
    assert mask_token_from_counts(2, np.array([3, 2, 5, 1, 1])) == 4


def test_read_eval_examples_in_file_order(tmp_path):
    import pyarrow.parquet as pq

    (tmp_path / "eval").mkdir()  # the split-folders layout, no manifest
    pq.write_table(table([([1, 2, 3], [0, 1, 1], True)] * 3), tmp_path / "eval" / "part-1.parquet")
    pq.write_table(table([([4, 5, 6], [0, 1, 1], True), ([4, 5, 6], [0, 0, 0], False)]),
                   tmp_path / "eval" / "part-0.parquet")
    got = read_eval_examples(str(tmp_path), limit=3)
    assert [e.input_ids[0] for e in got] == [4, 1, 1]
    assert read_eval_examples(str(tmp_path / "nowhere"), limit=3) == []
