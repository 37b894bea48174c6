"""Where the engine's drafts start, and what each head accepts there.

    python benchmarks/anchors.py [--setting tiny] [--k 5] [--head LABEL=DIR ...]

On the protocol's cached target, data and heads (`benchmarks/protocol.py --setting ...` writes
them): each head drafts K tokens from every position of the evaluation prompts' greedy replies, the
way the engine drafts (teacher-forced, `aerie.heads.losses.drafted_grid`), and its per-position
acceptance is counted three ways. From every position (the trainer's `chain_d`); at the positions
its own greedy walk drafts from (`walk_chain_d`: the engine's acceptance, within a few hundredths),
split by how many tokens the draft before had accepted (K: none missed); and at the positions the
other heads' walks draft from. Right after a head's own miss is where it drafts most often and where
the stretches it models worst are: the split says how much of its gap is where its drafts start,
and the other heads' rows at the same anchors say how hard those positions are for any head.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from protocol import SETTINGS, examples

from aerie.heads.fit import Example, collate, iterate_batches
from aerie.heads.io import load_head
from aerie.heads.losses import accepted_drafts, drafted_grid, prepare_batch, walk_anchors
from aerie.target import load_target


def accepted_runs(
    head, target, replies: list[Example], k: int, passes: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per reply: ([n, K] whether a draft from each row accepts depths 1..K, [n] reply rows); a
    P-EAGLE head drafts in `passes` forwards (default its own `draft_passes`)."""
    runs = []
    for batch in iterate_batches(replies, 4):
        hb = prepare_batch(target, head, *collate(batch))
        correct, fed_ok, counted = drafted_grid(head, hb, k, passes)
        accepted = accepted_drafts(correct, fed_ok, counted)
        runs += list(zip(accepted.cpu(), counted[..., 0].cpu(), strict=True))
    return runs


def rates(total: torch.Tensor, count: int) -> str:
    return " ".join(f"{x:.3f}" for x in (total / max(count, 1)).tolist()) + f"  ({count})"


def walk_buckets(per_reply, k: int) -> list[dict[str, list[int]]]:
    """Per reply: the rows its walk drafts from, by how the draft before ended."""
    buckets = []
    for accepted, reply_rows in per_reply:
        reached = walk_anchors(accepted[None], reply_rows[None])[0]
        split = {"every draft": reached, "the first": reached[:1], "after a miss": [], "after a full draft": []}
        for before, a in zip(reached, reached[1:], strict=False):
            split["after a full draft" if int(accepted[before].sum()) == k else "after a miss"].append(a)
        buckets.append(split)
    return buckets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="tiny")
    parser.add_argument("--out", help="the protocol's folder (default .aerie/bench/protocol/<setting>)")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--head", action="append", default=[], metavar="LABEL=DIR",
                        help="more heads (default: the protocol's eagle3 and peagle)")
    parser.add_argument("--passes", type=int, help="P-EAGLE's forwards per draft (default: each head's own)")
    args = parser.parse_args()
    out = Path(args.out or f".aerie/bench/protocol/{args.setting}")
    target = load_target(SETTINGS[args.setting]["target"], device="cpu")
    data = json.loads((out / "data.json").read_text())
    replies = examples(data["eval_replies"])
    folders = {m: out / "heads" / m for m in ("eagle3", "peagle")} | dict(item.split("=", 1) for item in args.head)
    runs = {label: accepted_runs(load_head(Path(d), target).eval(), target, replies, args.k, args.passes)
            for label, d in folders.items()}
    width = max(map(len, runs))
    print(f"per-position acceptance at K={args.k} on {len(replies)} held-out replies (positions counted)")
    print("\nfrom every position")
    for label, per_reply in runs.items():
        everywhere = sum((a.float() * r[:, None]).sum(0) for a, r in per_reply)
        print(f"  {label:{width}}  {rates(everywhere, int(sum(r.sum() for _, r in per_reply)))}")
    for walker, per_reply in runs.items():
        buckets = walk_buckets(per_reply, args.k)
        for name in buckets[0]:
            print(f"\nwhere {walker}'s walk drafts, {name}")
            for label, drafted in runs.items():
                total, count = torch.zeros(args.k), 0
                for (accepted, _), split in zip(drafted, buckets, strict=True):
                    total += accepted[split[name]].float().sum(0)
                    count += len(split[name])
                print(f"  {label:{width}}  {rates(total, count)}")


if __name__ == "__main__":
    main()
