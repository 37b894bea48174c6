"""Head modules: shapes, the cache protocol, and training-time attention patterns that match how
the engine drafts."""

from __future__ import annotations

import pytest
import torch

from aerie.engine.cache import SlotKVCache
from aerie.heads import EagleHead, PEagleHead, new_head
from aerie.heads.layers import ListCache, causal_mask
from aerie.heads.losses import (
    PEagleElements,
    active_rows,
    peagle_forward,
    peagle_grid,
    peagle_loss,
    peagle_mask,
    peagle_sample,
    prepare_batch,
    shift_left,
    ttt_mask,
    unroll,
)
from aerie.heads.vocab import build_draft_vocab, token_counts
from tests.heads.conftest import VOCAB, random_batch

METHODS = ["eagle3", "peagle", "eagle"]


def make_head(target, method, draft=128, seed=0):
    ids, _, loss = random_batch(seed=5)
    vocab = build_draft_vocab(token_counts(ids.tolist(), loss.tolist(), VOCAB), draft)
    head = new_head(target, method, draft_vocab=vocab, seed=seed)
    # untrained norms are all ones; perturb every parameter so the tests exercise real weights
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return head.eval()


def inputs(target, head, batch=2, q=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 1, (batch, q), generator=g)
    pos = torch.arange(3, 3 + q).expand(batch, q)
    width = head.config.feature_size
    feats = torch.randn(batch, q, width, generator=g)
    return ids, pos, feats


@pytest.mark.parametrize("method", METHODS)
def test_logits_at_selects_positions_without_changing_them(target, method):
    """Drafting reads a catch-up block's logits at one position per row (P-EAGLE: K of them); the
    head projects only those onto its vocabulary, and they equal the full forward's."""
    head = make_head(target, method)
    ids, pos, feats = inputs(target, head)
    full = head(ids, pos, features=feats)
    at = torch.tensor([[6], [2]])
    picked = head(ids, pos, features=feats, logits_at=at)
    vocab = full.logits.shape[-1]
    assert picked.logits.shape == (2, 1, vocab)
    torch.testing.assert_close(picked.logits, full.logits.gather(1, at[..., None].expand(-1, -1, vocab)))
    torch.testing.assert_close(picked.hidden, full.hidden)


@pytest.mark.parametrize("method", METHODS)
def test_shapes_and_api(target, method):
    head = make_head(target, method)
    assert head.method == method
    assert head.feature_kind == ("last" if method == "eagle" else "eagle3")
    ids, pos, feats = inputs(target, head)
    out = head(ids, pos, features=feats)
    draft_vocab = VOCAB if method == "eagle" else 128
    assert out.hidden.shape == (2, 7, 64)
    assert out.logits.shape == (2, 7, draft_vocab)
    again = head(ids, pos, hidden=out.hidden)
    assert again.logits.shape == out.logits.shape
    with pytest.raises(ValueError):
        head(ids, pos, features=feats, hidden=out.hidden)
    with pytest.raises(ValueError):
        head(ids, pos)
    assert (head.num_layers, head.kv_heads, head.head_dim) == (head.config.num_layers, 2, 16)
    targets = head.draft_to_target(out.logits.argmax(-1))
    assert int(targets.max()) < VOCAB
    if method != "eagle":
        assert bool(head.t2d[targets].all())
        assert torch.equal(head.target_to_draft(targets), out.logits.argmax(-1))
    # the target's embedding is copied in; frozen except for P-EAGLE
    if method != "peagle":
        assert torch.equal(head.embed_tokens.weight, target.embed_tokens.weight)
    assert head.embed_tokens.weight.requires_grad == (method == "peagle")


def test_eagle_uses_target_lm_head(target):
    head = make_head(target, "eagle")
    assert isinstance(head, EagleHead)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight)
    assert not head.lm_head.weight.requires_grad
    ids, pos, feats = inputs(target, head)
    out = head(ids, pos, features=feats)
    assert torch.allclose(out.logits, target.lm_head(out.hidden), atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_cache_path_equals_no_cache_path(target, method):
    head = make_head(target, method)
    ids, pos, feats = inputs(target, head, q=9)
    with torch.no_grad():
        full = head(ids, pos, features=feats)
        cache = ListCache(head.num_layers)
        steps = [
            head(ids[:, i : i + 1], pos[:, i : i + 1], features=feats[:, i : i + 1], cache=cache) for i in range(9)
        ]
    logits = torch.cat([s.logits for s in steps], dim=1)
    hidden = torch.cat([s.hidden for s in steps], dim=1)
    torch.testing.assert_close(logits, full.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, full.hidden, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("by_runs", [False, True])
@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_engine_slot_cache_protocol(target, method, by_runs):
    """The head runs on the engine's SlotKVCache: prefill 5 tokens, then 3 one at a time, in slots
    2 and 0 (gathered, or read by runs straight from the pool)."""
    head = make_head(target, method)
    ids, pos, feats = inputs(target, head, q=8)
    cache = SlotKVCache(
        head.num_layers,
        slots=4,
        kv_heads=head.kv_heads,
        head_dim=head.head_dim,
        capacity=32,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        full = head(ids, pos, features=feats)
        slots = [2, 0]
        cols = torch.arange(5).expand(2, 5)
        cache.bind(slots, cols, kv_len=5, by_runs=by_runs)
        assert (cache.segments is not None) == by_runs
        first = head(
            ids[:, :5],
            pos[:, :5],
            features=feats[:, :5],
            attention_mask=causal_mask(5, 5, ids.device).expand(2, 1, 5, 5),
            cache=cache,
        )
        outs = [first.logits]
        for i in range(5, 8):
            cache.bind(slots, torch.full((2, 1), i), kv_len=i + 1, by_runs=by_runs)
            mask = torch.ones(2, 1, 1, i + 1, dtype=torch.bool)
            outs.append(
                head(
                    ids[:, i : i + 1],
                    pos[:, i : i + 1],
                    features=feats[:, i : i + 1],
                    attention_mask=mask,
                    cache=cache,
                ).logits
            )
    torch.testing.assert_close(torch.cat(outs, 1), full.logits, atol=1e-5, rtol=1e-5)


def test_ttt_mask_pattern():
    valid = torch.tensor([[True, True, True, False]])
    m = ttt_mask(valid, 2)[0, 0].int()
    expected = torch.tensor(
        [
            # step-0 keys (causal, padding hidden) | step-1 keys (same row) | step-2 keys
            [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
            [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],
            [1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1],
        ]
    )
    assert torch.equal(m, expected)


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_ttt_unroll_equals_cached_chain_drafting(target, method):
    """Training-time test step k at row j gives exactly what drafting a chain from row j gives
    at inference: prefill rows 0..j with target features into the head cache, then feed each
    step's token with the previous step's hidden state."""
    head = make_head(target, method)
    ids, attn, loss = random_batch(batch=2, length=16, seed=3)
    hb = prepare_batch(target, head, ids, attn, loss)
    steps = 4
    with torch.no_grad():
        unrolled = [out for _, out, _ in unroll(head, hb, steps)]
        for b, j in [(0, 2), (0, 9), (1, 6)]:
            cache = ListCache(head.num_layers)
            out = head(
                hb.input_ids[b : b + 1, : j + 1],
                hb.position_ids[b : b + 1, : j + 1],
                features=hb.features[b : b + 1, : j + 1],
                cache=cache,
            )
            torch.testing.assert_close(out.logits[0, j], unrolled[0].logits[b, j], atol=1e-5, rtol=1e-5)
            hidden = out.hidden[:, -1:]
            for k in range(1, steps):
                tok = hb.input_ids[b : b + 1, j + k : j + k + 1]
                p = hb.position_ids[b : b + 1, j : j + 1] + k
                out = head(tok, p, hidden=hidden, cache=cache)
                torch.testing.assert_close(out.logits[0, 0], unrolled[k].logits[b, j], atol=1e-5, rtol=1e-5)
                hidden = out.hidden


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_unroll_on_active_rows_matches_all_rows(target, method):
    """Steps >= 1 computed only on the rows a loss needs give the same drafts there."""
    head = make_head(target, method)
    ids, attn, loss = random_batch(batch=3, length=20, seed=6)
    hb = prepare_batch(target, head, ids, attn, loss)
    rows, needed = active_rows(hb.loss_mask, 3)
    assert rows.shape[1] < hb.input_ids.shape[1]
    need = hb.loss_mask | shift_left(hb.loss_mask, 1, False) | shift_left(hb.loss_mask, 2, False)
    assert int(needed.sum()) == int(need.sum())
    with torch.no_grad():
        full = [out for _, out, _ in unroll(head, hb, 3)]
        part = [(out, at) for _, out, at in unroll(head, hb, 3, rows)]
    for k in range(3):
        out, at = part[k]
        for b in range(3):
            for i in range(at.shape[1]):
                if k == 0 or bool(needed[b, i]):
                    j = int(at[b, i])
                    torch.testing.assert_close(out.logits[b, i], full[k].logits[b, j], atol=1e-5, rtol=1e-5)


def test_ttt_mask_on_row_subset():
    valid = torch.tensor([[True, True, True, True]])
    rows = torch.tensor([[1, 3]])
    m = ttt_mask(valid, 1, rows)[0, 0].int()
    expected = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 0, 1]])
    assert torch.equal(m, expected)


def test_peagle_mask_pattern():
    # anchors/depths as in the notes: depth 0 at 0..3, depth 1 at anchors 0 and 2, depth 2 at anchor 0
    anchor = torch.tensor([[0, 1, 2, 3, 0, 2, 0]])
    depth = torch.tensor([[0, 0, 0, 0, 1, 1, 2]])
    present = torch.tensor([[True] * 6 + [True]])
    m = peagle_mask(anchor, depth, present)[0, 0].int()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0],
            [1, 0, 0, 0, 1, 0, 0],  # (0,1): context up to anchor 0 + itself
            [1, 1, 1, 0, 0, 1, 0],  # (2,1): context up to anchor 2 + itself
            [1, 0, 0, 0, 1, 0, 1],  # (0,2): context, (0,1), itself
        ]
    )
    assert torch.equal(m, expected)
    present[0, 3] = False
    assert not peagle_mask(anchor, depth, present)[0, 0, :, 3].any()


def test_peagle_training_forward_equals_parallel_drafting(target):
    """Element (anchor a, depth d) of the training forward equals the one-forward drafting the
    engine does after a real position a: real rows 0..a plus K-1 placeholder slots."""
    head = make_head(target, "peagle")
    assert isinstance(head, PEagleHead)
    ids, attn, loss = random_batch(batch=2, length=16, seed=4)
    hb = prepare_batch(target, head, ids, attn, loss)
    k = 4
    loss_all = torch.ones_like(hb.loss_mask) & hb.valid
    elements = PEagleElements.pack(peagle_grid(hb.valid, loss_all, k), hb.input_ids.device)
    with torch.no_grad():
        out, _row = peagle_forward(head, hb, elements)
        for b, a in [(0, 0), (0, 5), (1, 7)]:
            real = slice(0, a + 1)
            # what the engine feeds: real rows 0..a, then K-1 placeholders (mask token + mask_hidden)
            p_ids = torch.cat([hb.input_ids[b : b + 1, real], torch.full((1, k - 1), head.mask_token_id)], dim=1)
            steps = torch.arange(1, k, dtype=hb.position_ids.dtype)
            p_pos = torch.cat([hb.position_ids[b : b + 1, real], hb.position_ids[b : b + 1, a : a + 1] + steps], dim=1)
            mask_feats = head.mask_hidden.to(hb.features.dtype).expand(1, k - 1, -1)
            p_feats = torch.cat([hb.features[b : b + 1, real], mask_feats], dim=1)
            assert p_ids.shape == (1, a + k)
            assert int(p_pos[0, -1]) == int(hb.position_ids[b, a]) + k - 1
            drafted = head(p_ids, p_pos, features=p_feats).logits[0, -k:]
            for d in range(k):
                if a + d >= int(hb.valid[b].sum()):
                    continue
                e = int(((elements.anchor[b] == a) & (elements.depth[b] == d) & elements.present[b]).nonzero())
                torch.testing.assert_close(out.logits[b, e], drafted[d], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("top1_weight", "depth0_weight", "depth0_top1_weight"), [(0.0, 1.0, 0.0), (0.5, 3.0, 0.3)])
def test_peagle_loss_on_counted_elements_equals_the_loss_over_every_element(
    target, top1_weight, depth0_weight, depth0_top1_weight
):
    """The loss projects to the vocabulary only where a reply row is predicted; the value and its
    gradients are those of the loss over every element's logits, masked: `depth0_top1_weight` x CE
    of the target's top-1 + the rest x soft CE at depth 0, the same with `top1_weight` at the blind
    depths, the mean weighted `depth0_weight` : 1 between depth 0's elements and the blind depths'."""
    head = make_head(target, "peagle").train()
    ids, attn, loss = random_batch(batch=3, length=20, seed=6)
    loss[:, :8] = False  # a prompt: context only
    hb = prepare_batch(target, head, ids, attn, loss)
    out = peagle_loss(
        head, hb, depths=4, generator=torch.Generator().manual_seed(3), top1_weight=top1_weight,
        depth0_weight=depth0_weight, depth0_top1_weight=depth0_top1_weight,
    )
    grads = torch.autograd.grad(out.loss, [head.fc.weight, head.mask_hidden])

    rows = peagle_sample(hb.valid, hb.loss_mask, 4, generator=torch.Generator().manual_seed(3))
    elements = PEagleElements.pack(rows, hb.input_ids.device)
    full, row = peagle_forward(head, hb, elements)
    weight = elements.present & hb.loss_mask.gather(1, row) & hb.in_vocab.gather(1, row)
    labels = hb.target_logits.gather(1, row[..., None].expand(-1, -1, hb.target_logits.shape[-1]))
    soft = -(torch.softmax(labels, -1) * torch.log_softmax(full.logits, -1)).sum(-1)
    hard = torch.nn.functional.cross_entropy(full.logits.flatten(0, 1), labels.argmax(-1).flatten(), reduction="none")
    share = torch.where(elements.depth > 0, top1_weight, depth0_top1_weight)
    ce = (1 - share) * soft + share * hard.view_as(soft)
    weight = weight * torch.where(elements.depth == 0, depth0_weight, 1.0)
    reference = (ce * weight).sum() / weight.sum()
    assert bool(((weight == 0) & elements.present).any())  # some elements are context only
    torch.testing.assert_close(out.loss, reference)
    for got, want in zip(grads, torch.autograd.grad(reference, [head.fc.weight, head.mask_hidden]), strict=True):
        torch.testing.assert_close(got, want)


def test_prepare_batch_alignment(target):
    head = make_head(target, "eagle3")
    ids, attn, loss = random_batch(batch=2, length=12, seed=2)
    hb = prepare_batch(target, head, ids, attn, loss)
    out = target.forward(ids, torch.arange(12).expand(2, 12), attention_mask=attn, features="eagle3")
    assert torch.equal(hb.input_ids, ids[:, 1:])
    assert torch.equal(hb.position_ids[0], torch.arange(1, 12))
    torch.testing.assert_close(hb.features, out.features[:, :-1])
    assert torch.equal(hb.target_top1, out.logits[:, 1:].argmax(-1))
    # row j predicts token j+2: counted when that token is a reply token
    for b in range(2):
        n = int(attn[b].sum())
        for j in range(11):
            assert bool(hb.loss_mask[b, j]) == (j + 2 < n and bool(loss[b, j + 2]))
    torch.testing.assert_close(hb.target_logits, out.logits[:, 1:][..., head.t2d])
