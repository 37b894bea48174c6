"""Training objectives and agreement metrics for the three head families.

All of them work in the *head frame*. A padded batch of sequences x_0..x_{N-1} with target logits
l_i (the target's distribution of x_{i+1}) and features g_i becomes, at head row j = 0..N-2:

    token x_{j+1}, position j+1, feature g_j, label l_{j+1} (the distribution of x_{j+2}),
    loss mask m_{j+2} (x_{j+2} is a reply token), and for EAGLE the regression target g_{j+1}.

This is the pairing the engine uses at inference: the token just produced with the feature of the
position before it. Losses count a row only inside the loss mask and where the target's top-1
token is in the draft vocabulary; metrics count every reply row (a token outside the draft
vocabulary is simply a miss, as it is for the engine).

- EAGLE-3 training-time test (`ttt_loss`): n unrolled steps through a `ListCache`; step k feeds
  token x_{j+1+k} and the head's own step k-1 output hidden state, at position j+1+k. Its queries
  see the step-0 keys causally plus, from each step 1..k, only the key of the same row (`ttt_mask`),
  exactly what the head's KV cache holds when the engine drafts a chain from row j. Loss:
  sum_k decay^k * mean CE(q_draft, label), the label the target's distribution over the draft
  vocabulary with `top1_weight` of it moved to the target's top-1 token.
- P-EAGLE (`peagle_loss`): depth-sampled (anchor, depth) elements in one forward, the attention
  pattern of `peagle_mask`, count-normalised CE (the target's top-1 mixed into every label, a
  larger share at the blind depths), no per-depth decay.
- EAGLE (`eagle_loss`): smooth-L1 regression of the next feature + 0.1 x token soft CE through the
  target's lm_head (EAGLE's weights 1.0 / 0.1), optionally unrolled like TTT.

Agreement (`Agreement`): at depth d = 1..K, the fraction of reply rows where the head's top-1
(mapped to target ids) equals the target's top-1 (`acc`), and the fraction where depths 1..d all
agree and every fed-back token is the target's own top-1 (`chain`): the per-position acceptance
rate of greedy chain verification. `tau = 1 + sum_d chain_d` is the mean acceptance length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from aerie.heads.base import DraftHead
from aerie.heads.distill import distill_cross_entropy
from aerie.heads.layers import ListCache

# ---- the head frame ----------------------------------------------------------------------------


@dataclass
class HeadBatch:
    """A batch in the head frame (see the module docstring); all [B, n] unless noted."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    features: torch.Tensor  # [B, n, F] target feature of the previous position
    valid: torch.Tensor  # the row's token exists (not padding)
    loss_mask: torch.Tensor  # the token this row predicts is a reply token
    target_logits: torch.Tensor  # [B, n, V_draft] target logits restricted to the draft vocabulary
    target_top1: torch.Tensor  # target top-1 token (target ids)
    in_vocab: torch.Tensor  # target top-1 is in the draft vocabulary
    next_features: torch.Tensor | None = None  # [B, n, H] EAGLE regression target

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]


def head_vocab_mask(head: DraftHead) -> torch.Tensor | None:
    """t2d of a reduced-vocabulary head, None when the head drafts over the whole vocabulary."""
    t2d = getattr(head, "t2d", None)
    if t2d is None or bool(t2d.all()):
        return None
    return t2d


@torch.no_grad()
def prepare_batch(
    target,
    head: DraftHead,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
) -> HeadBatch:
    """Run the frozen target over a right-padded batch ([B, N] ids, 0/1 attention mask, bool
    loss mask over the tokens) and cut the head-frame tensors out of its logits and features."""
    device = target.device
    input_ids = input_ids.to(device)
    attention_mask = attention_mask.to(device)
    loss_mask = loss_mask.to(device).bool()
    batch, length = input_ids.shape
    if length < 3:
        raise ValueError("sequences need at least 3 tokens to train a head")
    positions = torch.arange(length, device=device).expand(batch, length)
    out = target.forward(input_ids, positions, attention_mask=attention_mask.long(), features=head.feature_kind)
    valid_tokens = attention_mask.bool()
    logits = out.logits[:, 1:]
    top1 = logits.argmax(-1)
    t2d = head_vocab_mask(head)
    if t2d is not None:
        draft_logits = logits[..., t2d]
        in_vocab = t2d[top1]
    else:
        draft_logits = logits
        in_vocab = torch.ones_like(top1, dtype=torch.bool)
    predicted = loss_mask & valid_tokens
    lmask = torch.zeros(batch, length - 1, dtype=torch.bool, device=device)
    lmask[:, :-1] = predicted[:, 2:]
    features = out.features
    return HeadBatch(
        input_ids=input_ids[:, 1:],
        position_ids=positions[:, 1:],
        features=features[:, :-1],
        valid=valid_tokens[:, 1:],
        loss_mask=lmask,
        target_logits=draft_logits.float(),
        target_top1=top1,
        in_vocab=in_vocab,
        next_features=features[:, 1:] if head.feature_kind == "last" else None,
    )


def shift_left(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """x[:, j] <- x[:, j + k] along dim 1, `fill` past the end."""
    if k == 0:
        return x
    out = torch.full_like(x, fill)
    if k < x.shape[1]:
        out[:, : x.shape[1] - k] = x[:, k:]
    return out


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


@dataclass
class LossOutput:
    """A scalar loss to backpropagate and plain-float metrics of the batch (per depth d = 1..:
    `loss_d`, and `acc_d` the top-1 agreement with the target)."""

    loss: torch.Tensor
    metrics: dict[str, float]


def _step_metrics(step_losses: list[float], agreement: Agreement) -> dict[str, float]:
    metrics = {f"loss_{d}": v for d, v in enumerate(step_losses, start=1)}
    metrics.update({f"acc_{d}": v for d, v in enumerate(agreement.acc, start=1)})
    return metrics


# ---- agreement metrics -------------------------------------------------------------------------


@dataclass
class Agreement:
    """Summed counts per depth 1..K; merge across batches (or workers) by adding.

    `chain` counts every reply row as an anchor. The engine drafts only from the rows its greedy
    walk reaches (each draft starts right after the last one's accepted run), and those follow a
    miss more often than not, so `visited` / `visits` count the chain at those anchors alone: the
    acceptance the engine measures when it decodes the same reply at K = depth.
    """

    correct: list[float] = field(default_factory=list)
    chain: list[float] = field(default_factory=list)
    count: list[float] = field(default_factory=list)
    visited: list[float] = field(default_factory=list)
    visits: float = 0.0

    @classmethod
    def from_grid(cls, correct: torch.Tensor, fed_ok: torch.Tensor, counted: torch.Tensor) -> Agreement:
        """correct/counted [B, n, K]: depth-d top-1 agreement and whether it is a reply row;
        fed_ok [B, n, K]: the token fed at depth d (d >= 1) is the target's own top-1."""
        accepted = accepted_drafts(correct, fed_ok, counted)
        counted_f = counted.float()
        visited, visits = _walk(accepted, counted[..., 0])
        return cls(
            correct=(correct.float() * counted_f).sum((0, 1)).tolist(),
            chain=accepted.float().sum((0, 1)).tolist(),
            count=counted_f.sum((0, 1)).tolist(),
            visited=visited,
            visits=visits,
        )

    def merge(self, other: Agreement) -> Agreement:
        if not self.count or not other.count:
            only = other if not self.count else self
            return Agreement(list(only.correct), list(only.chain), list(only.count), list(only.visited), only.visits)
        depth = min(len(self.count), len(other.count))

        def add(a: list[float], b: list[float]) -> list[float]:
            return [x + y for x, y in zip(a[:depth], b[:depth], strict=True)]

        return Agreement(
            add(self.correct, other.correct),
            add(self.chain, other.chain),
            add(self.count, other.count),
            add(self.visited, other.visited),
            self.visits + other.visits,
        )

    @property
    def acc(self) -> list[float]:
        return [c / n if n else 0.0 for c, n in zip(self.correct, self.count, strict=True)]

    @property
    def chain_rate(self) -> list[float]:
        return [c / n if n else 0.0 for c, n in zip(self.chain, self.count, strict=True)]

    @property
    def visited_rate(self) -> list[float]:
        return [c / self.visits if self.visits else 0.0 for c in self.visited]

    @property
    def tau(self) -> float:
        return 1.0 + sum(self.chain_rate)

    def summary(self, prefix: str = "") -> dict[str, float]:
        out: dict[str, float] = {}
        for d, (a, c) in enumerate(zip(self.acc, self.chain_rate, strict=True), start=1):
            out[f"{prefix}acc_{d}"] = a
            out[f"{prefix}chain_{d}"] = c
        if self.count:
            out[f"{prefix}tau"] = self.tau
        if self.visits:
            out.update({f"{prefix}walk_chain_{d}": v for d, v in enumerate(self.visited_rate, start=1)})
            out[f"{prefix}walk_tau"] = 1.0 + sum(self.visited_rate)
        return out


def accepted_drafts(correct: torch.Tensor, fed_ok: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """[B, n, K]: whether greedy chain verification of a draft from reply row j accepts its depth-d
    token (`Agreement.from_grid`'s inputs): it and every depth before it agree, fed the target's own
    tokens."""
    return torch.cumprod((correct & fed_ok).long(), dim=-1).bool() & counted


def _walk(accepted: torch.Tensor, anchors: torch.Tensor) -> tuple[list[float], float]:
    """Greedy chain verification's walk over each row: the prefill emits the first reply token,
    then each draft from anchor a accepts its run of `accepted` [B, n, K] (cumulative per depth)
    and the next starts one past it (the bonus token). `anchors` [B, n]: the rows whose next token
    is a reply token. Returns the per-depth acceptance summed over the anchors reached, and how
    many there were."""
    reached = walk_anchors(accepted, anchors)
    rows = torch.tensor([b for b, row in enumerate(reached) for _ in row], dtype=torch.long, device=accepted.device)
    cols = torch.tensor([a for row in reached for a in row], dtype=torch.long, device=accepted.device)
    return accepted[rows, cols].float().sum(0).tolist(), float(rows.numel())


def walk_anchors(accepted: torch.Tensor, anchors: torch.Tensor) -> list[list[int]]:
    """Per row of `accepted` [B, n, K] (cumulative per depth) and `anchors` [B, n] (as `_walk`
    takes them): the rows greedy chain verification drafts from, in order."""
    reached: list[list[int]] = []
    for per_anchor, row in zip(accepted.long().tolist(), anchors.tolist(), strict=True):
        a = row.index(True) + 1 if True in row else len(row)
        reached.append([])
        while a < len(row) and row[a]:
            reached[-1].append(a)
            a += sum(per_anchor[a]) + 1
    return reached


def _grid(hb: HeadBatch, preds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`Agreement.from_grid`'s inputs for chain predictions preds[k] [B, n] (target ids) made at
    row j, depth k+1."""
    correct, fed_ok, counted = [], [], []
    for k, pred in enumerate(preds):
        correct.append(pred == shift_left(hb.target_top1, k, -1))
        counted.append(shift_left(hb.loss_mask, k, False))
        if k == 0:
            fed_ok.append(torch.ones_like(pred, dtype=torch.bool))
        else:
            fed_ok.append(shift_left(hb.input_ids, k, -2) == shift_left(hb.target_top1, k - 1, -3))
    return torch.stack(correct, -1), torch.stack(fed_ok, -1), torch.stack(counted, -1)


# ---- EAGLE-3 training-time test (and the sequential unroll all chain heads share) --------------


def ttt_mask(valid: torch.Tensor, step: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The training-time-test mask for unrolled step `step`: queries are the head-frame rows
    `rows` [B, m] (all n rows when None); keys are the n step-0 keys, then m keys per step 1..step.
    A query sees the step-0 keys of its own and earlier rows (padding hidden) and, from each later
    step, only its own key. [B, 1, m, n + step * m] bool."""
    batch, n = valid.shape
    device = valid.device
    if rows is None:
        rows = torch.arange(n, device=device).expand(batch, n)
    m = rows.shape[1]
    columns = torch.arange(n, device=device)
    blocks = [(columns[None, None, :] <= rows[:, :, None]) & valid[:, None, :]]
    eye = torch.eye(m, dtype=torch.bool, device=device)[None].expand(batch, m, m)
    blocks += [eye] * step
    return torch.cat(blocks, dim=-1)[:, None]


def active_rows(loss_mask: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose chain of `steps` drafts reaches a counted row: ([B, m] row indices in ascending
    order, [B, m] bool which of them are needed; the rest pad short rows). Steps >= 1 of the
    training-time test only need these rows, so prompts cost one step, not `steps`."""
    need = torch.zeros_like(loss_mask)
    for k in range(steps):
        need |= shift_left(loss_mask, k, False)
    rows = true_first(need)
    return rows, need.gather(1, rows)


def true_first(selected: torch.Tensor) -> torch.Tensor:
    """[B, m] indices of each row's True entries of `selected` [B, n], ascending, padded with others
    (m: the most True entries of any row, at least 1)."""
    batch, n = selected.shape
    m = max(1, int(selected.sum(1).max()))
    index = torch.arange(n, device=selected.device).expand(batch, n)
    return torch.sort(torch.argsort((~selected).long() * n + index, dim=1)[:, :m], dim=1).values


def _take(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [B, n, ...] at row indices [B, m]."""
    if x.dim() == 2:
        return x.gather(1, rows)
    return x.gather(1, rows[..., None].expand(-1, -1, *x.shape[2:]))


def unroll(
    head: DraftHead,
    hb: HeadBatch,
    steps: int,
    rows: torch.Tensor | None = None,
    first_rows: torch.Tensor | None = None,
):
    """The chain a head drafts from every row at once: `steps` forwards through one ListCache.

    Step 0 runs over all n rows (its keys are everybody's context), its logits only at
    `first_rows` [B, m_0] when given (the rows a loss or metric reads: the prompt's rows are context
    only); steps >= 1 over `rows` [B, m] only (all rows when None; `active_rows` picks the ones a
    loss needs). Yields (k, HeadOutput, row indices [B, m_k] of its logits) for k = 0..steps-1;
    step k at row j drafts the token at row j + k + 1 from token x_{j+1+k} and the step k-1 hidden
    state of row j.
    """
    batch, n = hb.input_ids.shape
    all_rows = torch.arange(n, device=hb.input_ids.device).expand(batch, n)
    cache = ListCache(head.num_layers)
    out = head(
        hb.input_ids, hb.position_ids, features=hb.features, attention_mask=ttt_mask(hb.valid, 0), cache=cache,
        logits_at=first_rows,
    )
    yield 0, out, all_rows if first_rows is None else first_rows
    rows = all_rows if rows is None else rows
    hidden = _take(out.hidden, rows)
    positions = _take(hb.position_ids, rows)
    for k in range(1, steps):
        ids = _take(hb.input_ids, (rows + k).clamp(max=n - 1))
        mask = ttt_mask(hb.valid, k, rows)
        out = head(ids, positions + k, hidden=hidden, attention_mask=mask, cache=cache)
        hidden = out.hidden
        yield k, out, rows


def _at_step(x: torch.Tensor, rows: torch.Tensor, k: int, fill) -> torch.Tensor:
    """x at rows + k (fill past the end)."""
    n = x.shape[1]
    target_rows = rows + k
    taken = _take(x, target_rows.clamp(max=n - 1))
    inside = target_rows < n
    if taken.dim() > 2:
        inside = inside[..., None]
    return torch.where(inside, taken, torch.as_tensor(fill, dtype=taken.dtype, device=taken.device))


def _drafted_grid(head: DraftHead, drafted: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """The head's top-1 drafts (`drafted` [B, m], draft ids) made at `rows`, as target ids
    scattered into [B, n] (-1 elsewhere)."""
    pred = head.draft_to_target(drafted)
    full = torch.full((pred.shape[0], n), -1, dtype=pred.dtype, device=pred.device)
    return full.scatter(1, rows, pred)


def ttt_loss(
    head: DraftHead, hb: HeadBatch, steps: int = 3, decay: float = 0.8, top1_weight: float = 0.3
) -> LossOutput:
    """EAGLE-3 training-time test over `steps` unrolled steps, weights decay^k. Each label is
    `top1_weight` x the target's top-1 token + the rest x its distribution (`fit.TrainConfig.top1_weight`)."""
    total = torch.zeros((), device=hb.input_ids.device)
    preds, step_losses = [], []
    n = hb.input_ids.shape[1]
    rows, needed = active_rows(hb.loss_mask, steps)
    for k, out, at in unroll(head, hb, steps, rows, first_rows=true_first(hb.loss_mask)):
        weight = _at_step(hb.loss_mask, at, k, False) & _at_step(hb.in_vocab, at, k, False)
        if k > 0:
            weight = weight & needed
        ce, drafted = distill_cross_entropy(out.logits, hb.target_logits, (at + k).clamp(max=n - 1), top1_weight)
        step = _masked_mean(ce, weight)
        total = total + (decay**k) * step
        step_losses.append(float(step.detach()))
        preds.append(_drafted_grid(head, drafted, at, n))
    return LossOutput(total, _step_metrics(step_losses, Agreement.from_grid(*_grid(hb, preds))))


def eagle_loss(
    head: DraftHead,
    hb: HeadBatch,
    steps: int = 1,
    decay: float = 0.8,
    feature_weight: float = 1.0,
    token_weight: float = 0.1,
) -> LossOutput:
    """EAGLE: smooth-L1 on the predicted next feature + token soft CE, per unrolled step."""
    if hb.next_features is None:
        raise ValueError("the EAGLE loss needs next_features (prepare the batch with features='last')")
    total = torch.zeros((), device=hb.input_ids.device)
    preds, step_losses = [], []
    n = hb.input_ids.shape[1]
    rows, needed = active_rows(hb.loss_mask, steps)
    for k, out, at in unroll(head, hb, steps, rows):
        mask = _at_step(hb.loss_mask, at, k, False)
        if k > 0:
            mask = mask & needed
        goal = _at_step(hb.next_features, at, k, 0.0).to(out.hidden.dtype)
        vloss = _masked_mean(F.smooth_l1_loss(out.hidden, goal, reduction="none").mean(-1), mask)
        ce, drafted = distill_cross_entropy(out.logits, hb.target_logits, (at + k).clamp(max=n - 1))
        step = feature_weight * vloss + token_weight * _masked_mean(ce, mask)
        total = total + (decay**k) * step
        step_losses.append(float(step.detach()))
        preds.append(_drafted_grid(head, drafted, at, n))
    return LossOutput(total, _step_metrics(step_losses, Agreement.from_grid(*_grid(hb, preds))))


def _chain_drafts(head: DraftHead, hb: HeadBatch, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sequentially drafting head (EAGLE-3, EAGLE) at depths 1..depth, as `drafted_grid`."""
    n = hb.input_ids.shape[1]
    rows, _ = active_rows(hb.loss_mask, depth)
    unrolled = unroll(head, hb, depth, rows, first_rows=true_first(hb.loss_mask))
    preds = [_drafted_grid(head, out.logits.argmax(-1), at, n) for _, out, at in unrolled]
    return _grid(hb, preds)


# ---- P-EAGLE -----------------------------------------------------------------------------------


def peagle_sample(
    valid: torch.Tensor,
    loss_mask: torch.Tensor,
    depths: int = 8,
    ratio: float = 0.7,
    ratio_min: float = 0.2,
    generator: torch.Generator | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Depth sampling, per row: (anchors, depths) of the elements to train on.

    Depth 0 keeps every real row. Depth d >= 1 keeps floor((n_loss - d) * max(ratio^d, ratio_min))
    anchors, drawn uniformly from the depth d-1 anchors whose depth-d element is a reply row
    (the "+1-shifted survivors"); n_loss is the row's number of reply rows.
    """
    rows = []
    n = valid.shape[1]
    for b in range(valid.shape[0]):
        lmask = loss_mask[b].cpu()
        anchors = torch.nonzero(valid[b].cpu(), as_tuple=False).flatten()
        parts_a, parts_d = [anchors], [torch.zeros_like(anchors)]
        n_loss = int(lmask.sum())
        current = anchors
        for d in range(1, depths):
            reach = current + d
            ok = reach < n
            current = current[ok]
            current = current[lmask[current + d]]
            size = math.floor(max(0, n_loss - d) * max(ratio**d, ratio_min))
            if size <= 0 or current.numel() == 0:
                break
            if current.numel() > size:
                pick = torch.randperm(current.numel(), generator=generator, device="cpu")[:size]
                current = torch.sort(current[pick]).values
            parts_a.append(current)
            parts_d.append(torch.full_like(current, d))
        rows.append((torch.cat(parts_a), torch.cat(parts_d)))
    return rows


def peagle_grid(valid: torch.Tensor, loss_mask: torch.Tensor, depths: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every real row at depth 0 and every row whose depth-d element is a reply row at depth d:
    what the engine's one-forward drafting of K = depths tokens does from each position."""
    rows = []
    n = valid.shape[1]
    for b in range(valid.shape[0]):
        lmask = loss_mask[b].cpu()
        anchors = torch.nonzero(valid[b].cpu(), as_tuple=False).flatten()
        parts_a, parts_d = [anchors], [torch.zeros_like(anchors)]
        for d in range(1, depths):
            keep = anchors[(anchors + d < n)]
            keep = keep[lmask[keep + d]]
            parts_a.append(keep)
            parts_d.append(torch.full_like(keep, d))
        rows.append((torch.cat(parts_a), torch.cat(parts_d)))
    return rows


def peagle_mask(anchor: torch.Tensor, depth: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """[B, 1, E, E] bool: query (a, d) sees key (a', d') iff the key is present and either
    (d' == 0 and a' <= a) or (a' == a and d' <= d)."""
    qa, ka = anchor[:, :, None], anchor[:, None, :]
    qd, kd = depth[:, :, None], depth[:, None, :]
    mask = ((kd == 0) & (ka <= qa)) | ((ka == qa) & (kd <= qd))
    return (mask & present[:, None, :])[:, None]


@dataclass
class PEagleElements:
    """Padded (anchor, depth) elements of a batch: [B, E] each."""

    anchor: torch.Tensor
    depth: torch.Tensor
    present: torch.Tensor

    @classmethod
    def pack(cls, rows: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> PEagleElements:
        width = max(a.numel() for a, _ in rows)
        anchor = torch.zeros(len(rows), width, dtype=torch.long, device="cpu")
        depth = torch.zeros(len(rows), width, dtype=torch.long, device="cpu")
        present = torch.zeros(len(rows), width, dtype=torch.bool, device="cpu")
        for b, (a, d) in enumerate(rows):
            anchor[b, : a.numel()] = a
            depth[b, : a.numel()] = d
            present[b, : a.numel()] = True
        return cls(anchor.to(device), depth.to(device), present.to(device))

    def target_rows(self, n: int) -> torch.Tensor:
        """[B, E] the head-frame row each element predicts (its anchor plus its depth)."""
        return (self.anchor + self.depth).clamp(max=n - 1)


def peagle_forward(
    head,
    hb: HeadBatch,
    elements: PEagleElements,
    logits_at: torch.Tensor | None = None,
    fed: torch.Tensor | None = None,
):
    """One head forward over P-EAGLE elements. Returns (HeadOutput, target row index [B, E]);
    the logits only at the elements `logits_at` [B, m] when given. `fed` [B, E]: the token a
    placeholder reads instead of the mask token (-1: the mask token), as in a refining pass; its
    feature stays `mask_hidden`."""
    anchor, depth, present = elements.anchor, elements.depth, elements.present
    row = elements.target_rows(hb.input_ids.shape[1])
    is_mask = depth > 0
    ids = torch.where(is_mask, torch.full_like(anchor, head.mask_token_id), hb.input_ids.gather(1, anchor))
    if fed is not None:
        ids = torch.where(is_mask & (fed >= 0), fed, ids)
    positions = hb.position_ids.gather(1, anchor) + depth
    feats = hb.features.gather(1, anchor[..., None].expand(-1, -1, hb.features.shape[-1]))
    feats = torch.where(is_mask[..., None], head.mask_hidden.to(feats.dtype), feats.to(head.mask_hidden.dtype))
    mask = peagle_mask(anchor, depth, present)
    return head(ids, positions, features=feats, attention_mask=mask, logits_at=logits_at), row


def peagle_loss(
    head,
    hb: HeadBatch,
    depths: int = 8,
    ratio: float = 0.7,
    ratio_min: float = 0.2,
    generator: torch.Generator | None = None,
    top1_weight: float = 0.5,
    depth0_weight: float = 3.0,
    depth0_top1_weight: float = 0.3,
    fed_ratio: float = 0.0,
) -> LossOutput:
    """P-EAGLE: depth-sampled elements, count-normalised CE (metrics per depth over the sampled
    elements; `agreement` gives chain rates).

    Depth 0's label is `depth0_top1_weight` x the target's top-1 + the rest x its distribution, as
    EAGLE-3's (`ttt_loss`). A placeholder at depth d >= 1 does not see the tokens between its
    anchor and its own position, so the minimiser of the soft CE there is
    the target's distribution averaged over those unseen paths, whose argmax need not be the token
    greedy verification accepts most often: the target's top-1. Its label is therefore
    `top1_weight` x the top-1 token + (1 - `top1_weight`) x the target's distribution, which moves
    the minimiser's argmax to what acceptance rewards while keeping the soft target's signal (tiny
    protocol, held-out replies, tau@8: 5.74 soft only, 6.42 at 0.5, 6.21 at 1.0).

    Depth 0's elements weigh `depth0_weight` each against 1 for a blind depth's. Depth 0 is the only
    prediction that sees the newest token, every accepted run starts with it, and the blind depths'
    elements outnumber its own (2.4 to 1 at the default sampling) and pull the shared layers their
    way: with one layer and even weights, the top-1 mix cost depth 1 0.915 -> 0.865.

    A `fed_ratio` share of the anchors have their placeholders read the reply's own tokens instead
    of the mask token (a fed chain): what a refining pass reads, the first pass's drafts, where they
    are right. The per-depth metrics count the blind chains only."""
    # Depth 0 keeps the prompt's rows as context; only the counted elements (a reply row to
    # predict) pay for the vocabulary projection and the CE (`distill_cross_entropy`).
    rows = peagle_sample(hb.valid, hb.loss_mask, depths, ratio, ratio_min, generator)
    elements = PEagleElements.pack(rows, hb.input_ids.device)
    row = elements.target_rows(hb.input_ids.shape[1])
    at = true_first(elements.present & hb.loss_mask.gather(1, row))
    fed = _fed_chains(hb, elements, fed_ratio, generator) if fed_ratio > 0 else None
    out, _ = peagle_forward(head, hb, elements, logits_at=at, fed=fed)
    blind = torch.ones_like(at, dtype=torch.bool) if fed is None else fed.gather(1, at) < 0
    row, depth = row.gather(1, at), elements.depth.gather(1, at)
    counted = elements.present.gather(1, at) & hb.loss_mask.gather(1, row)
    weight = (counted & hb.in_vocab.gather(1, row)).float() * torch.where(depth == 0, depth0_weight, 1.0)
    share = torch.where(depth > 0, top1_weight, depth0_top1_weight)
    ce, drafted = distill_cross_entropy(out.logits, hb.target_logits, row, share)
    loss = _masked_mean(ce, weight)
    metrics: dict[str, float] = {}
    with torch.no_grad():
        correct = head.draft_to_target(drafted) == hb.target_top1.gather(1, row)
        for d in range(depths):
            sel = counted & blind & (depth == d)
            if not bool(sel.any()):
                break
            metrics[f"loss_{d + 1}"] = float(_masked_mean(ce, sel & (weight > 0)))
            metrics[f"acc_{d + 1}"] = float(_masked_mean(correct.float(), sel))
        metrics["elements"] = float(elements.present.sum())
    return LossOutput(loss, metrics)


def _fed_chains(
    hb: HeadBatch, elements: PEagleElements, ratio: float, generator: torch.Generator | None
) -> torch.Tensor:
    """`peagle_forward`'s `fed` for a `ratio` share of the anchors, drawn per anchor: each of its
    placeholders reads the reply's token at its own position."""
    chosen = torch.rand(hb.input_ids.shape, generator=generator, device="cpu") < ratio
    chosen = chosen.to(hb.input_ids.device).gather(1, elements.anchor) & (elements.depth > 0)
    truth = hb.input_ids.gather(1, elements.target_rows(hb.input_ids.shape[1]))
    return torch.where(chosen, truth, -1)


def _previous_drafts(elements: PEagleElements, drafts: torch.Tensor, n: int, depth: int) -> torch.Tensor:
    """`peagle_forward`'s `fed` for a refining pass: each placeholder reads the token the element
    before it in its chain drafted ([B, E] target ids, -1 for depth 0's elements)."""
    anchor, at_depth, present = elements.anchor, elements.depth, elements.present
    b_idx = torch.arange(anchor.shape[0], device=anchor.device)[:, None].expand_as(anchor)
    grid = torch.full((anchor.shape[0], n, depth), -1, dtype=torch.long, device=anchor.device)
    grid[b_idx[present], anchor[present], at_depth[present]] = drafts[present]
    before = grid[b_idx, anchor, (at_depth - 1).clamp(min=0)]
    return torch.where(at_depth > 0, before, -1)


def _peagle_drafts(
    head, hb: HeadBatch, depth: int, passes: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A P-EAGLE head drafting `depth` tokens from every row in one forward and `passes` - 1
    refining ones, as `drafted_grid`."""
    rows = peagle_grid(hb.valid, hb.loss_mask, depth)
    elements = PEagleElements.pack(rows, hb.input_ids.device)
    batch, n = hb.input_ids.shape
    fed = None
    for _ in range(passes):
        out, row = peagle_forward(head, hb, elements, fed=fed)
        pred = head.draft_to_target(out.logits.argmax(-1))
        fed = _previous_drafts(elements, pred, n, depth)
    ok = pred == hb.target_top1.gather(1, row)
    correct = torch.zeros(batch, n, depth, dtype=torch.bool, device=ok.device)
    counted = torch.zeros_like(correct)
    b_idx = torch.arange(batch, device=ok.device)[:, None].expand_as(row)
    sel = elements.present & hb.loss_mask.gather(1, row)
    correct[b_idx[sel], elements.anchor[sel], elements.depth[sel]] = ok[sel]
    counted[b_idx[sel], elements.anchor[sel], elements.depth[sel]] = True
    fed_ok = torch.stack(
        [torch.ones(batch, n, dtype=torch.bool, device=ok.device)]
        + [shift_left(hb.input_ids, k, -2) == shift_left(hb.target_top1, k - 1, -3) for k in range(1, depth)],
        dim=-1,
    )
    return correct, fed_ok, counted


@torch.no_grad()
def drafted_grid(
    head: DraftHead, hb: HeadBatch, depth: int, passes: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head drafting `depth` tokens from every row of `hb` the way the engine drafts (a chain,
    or P-EAGLE's one forward and `passes` - 1 refining ones, default its `draft_passes`):
    `Agreement.from_grid`'s (correct, fed_ok, counted), [B, n, depth]."""
    if head.method == "peagle":
        return _peagle_drafts(head, hb, depth, passes or head.config.draft_passes)
    return _chain_drafts(head, hb, depth)


def agreement(head: DraftHead, hb: HeadBatch, depth: int) -> Agreement:
    """Agreement of `head` at depths 1..depth on `hb` (`drafted_grid`)."""
    return Agreement.from_grid(*drafted_grid(head, hb, depth))
