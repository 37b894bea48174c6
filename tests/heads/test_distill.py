"""The chunked distillation CE against the same loss built from autograd ops."""

from __future__ import annotations

import pytest
import torch

from aerie.heads import distill
from aerie.heads.distill import distill_cross_entropy
from aerie.heads.losses import _at_step, active_rows, prepare_batch, ttt_loss, unroll
from tests.heads.conftest import random_batch
from tests.heads.test_heads import make_head


def reference_ce(logits, target_logits, rows, share):
    """(1 - share) soft CE + share hard CE against the target's top-1, from autograd ops."""
    labels = target_logits.gather(1, rows[..., None].expand(-1, -1, target_logits.shape[-1]))
    log_q = torch.log_softmax(logits.float(), dim=-1)
    soft = -(torch.softmax(labels, dim=-1) * log_q).sum(-1)
    hard = -log_q.gather(-1, labels.argmax(-1, keepdim=True))[..., 0]
    return (1 - share) * soft + share * hard


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_gradient_and_argmax_match_autograd(monkeypatch, dtype):
    monkeypatch.setattr(distill, "CHUNK_ROWS", 7)  # several chunks and a ragged last one
    g = torch.Generator().manual_seed(0)
    target_logits = 3 * torch.randn(3, 11, 40, generator=g, dtype=torch.float32)
    rows = torch.randint(0, 11, (3, 9), generator=g)
    share = torch.where(torch.rand(3, 9, generator=g) > 0.5, 0.5, 0.0)
    logits = (3 * torch.randn(3, 9, 40, generator=g)).to(dtype).requires_grad_()
    weight = torch.rand(3, 9, generator=g)

    ce, drafted = distill_cross_entropy(logits, target_logits, rows, share)
    (grad,) = torch.autograd.grad((ce * weight).sum(), logits)
    want = reference_ce(logits, target_logits, rows, share)
    (want_grad,) = torch.autograd.grad((want * weight).sum(), logits)

    assert ce.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(ce, want)
    torch.testing.assert_close(grad, want_grad)
    assert torch.equal(drafted, logits.detach().argmax(-1))
    assert not drafted.requires_grad


@pytest.mark.parametrize("top1_weight", [0.0, 0.3])
def test_ttt_loss_equals_the_ce_over_every_row(target, top1_weight):
    """Step 0's logits only at the reply rows and the chunked CE leave the loss and its gradient
    as the plain CE over every row gives them: `top1_weight` x CE of the target's top-1 + the rest
    x soft CE."""
    head = make_head(target, "eagle3")
    ids, attn, loss = random_batch(batch=3, length=20, seed=6)
    loss[:, :8] = False
    hb = prepare_batch(target, head, ids, attn, loss)
    out = ttt_loss(head, hb, steps=3, decay=0.8, top1_weight=top1_weight)
    grads = torch.autograd.grad(out.loss, [head.fc.weight, head.lm_head.weight])

    rows, needed = active_rows(hb.loss_mask, 3)
    reference = torch.zeros(())
    for k, step, at in unroll(head, hb, 3, rows):
        weight = _at_step(hb.loss_mask, at, k, False) & _at_step(hb.in_vocab, at, k, False)
        if k > 0:
            weight = weight & needed
        labels = _at_step(hb.target_logits, at, k, 0.0)
        own_rows = torch.arange(labels.shape[1], device=labels.device).expand(at.shape)
        ce = reference_ce(step.logits, labels, own_rows, top1_weight)
        reference = reference + 0.8**k * (ce * weight).sum() / weight.sum()
    torch.testing.assert_close(out.loss, reference)
    for got, want in zip(grads, torch.autograd.grad(reference, [head.fc.weight, head.lm_head.weight]), strict=True):
        torch.testing.assert_close(got, want)
