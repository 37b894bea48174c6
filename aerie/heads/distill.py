"""The distillation cross-entropy every head trains with, computed in row chunks.

A head's loss is, per element, the CE of its logits z [V] (over the draft vocabulary) against the
target's distribution p = softmax(l) at some row of the batch, optionally mixed with the target's
top-1 token: label = (1 - s) p + s onehot(argmax l). The label sums to one, so

    CE = logsumexp(z) - (1 - s) <p, z> - s z[argmax l],    dCE/dz = softmax(z) - label.

Built from autograd ops this materialises half a dozen [elements, V] float tensors (the gathered
labels, the float logits, log-softmax, their products and as many again in the backward); at the
sizes a head trains on (thousands of elements by a 2-32k vocabulary) they are far larger than the
CPU's caches and each costs a trip to memory, and a fresh one its page faults. Here the forward
computes the loss and its gradient together, chunk by chunk, in cache, and keeps only the gradient
(in the logits' dtype) for the backward, which scales it by the incoming gradient. The label rows
are taken with `F.embedding` (row copies; advanced indexing gathers element by element, dozens of
times slower on the CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ROWS = 256


def _chunks(total: int, size: int) -> range:
    return range(0, total, size)


class _DistillCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target_logits, rows, share):
        z_all = logits.reshape(-1, logits.shape[-1])
        ce = torch.empty(z_all.shape[0], dtype=torch.float32, device=logits.device)
        pred = torch.empty(z_all.shape[0], dtype=torch.long, device=logits.device)
        dce = torch.empty_like(z_all)  # dCE/dz, scaled by the incoming gradient in the backward
        for start in _chunks(z_all.shape[0], CHUNK_ROWS):
            part = slice(start, start + CHUNK_ROWS)
            z = z_all[part].float()
            label_logits = F.embedding(rows[part], target_logits)
            top1 = label_logits.argmax(-1, keepdim=True)
            s = share[part, None]
            label = torch.softmax(label_logits, dim=-1).mul_(1 - s).scatter_add_(1, top1, s)
            lse = torch.logsumexp(z, dim=-1, keepdim=True)
            ce[part] = (lse - (label * z).sum(-1, keepdim=True))[:, 0]
            pred[part] = z.argmax(-1)
            dce[part] = torch.exp(z.sub_(lse)).sub_(label)
        ctx.save_for_backward(dce)
        ctx.mark_non_differentiable(pred)
        return ce.view(logits.shape[:-1]), pred.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_ce, _grad_pred):
        (dce,) = ctx.saved_tensors
        grad = dce * grad_ce.reshape(-1, 1).to(dce.dtype)
        return grad.view(*grad_ce.shape, dce.shape[-1]), None, None, None


def distill_cross_entropy(
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    rows: torch.Tensor,
    top1_share: torch.Tensor | float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CE of `logits` [B, m, V] against the target's distribution at `rows` [B, m] of
    `target_logits` [B, n, V] (soft labels), `top1_share` [B, m] (or one float) of each label
    moved to the target's top-1 token there. Returns (ce [B, m] float32, the head's top-1 [B, m]
    draft ids, without gradient). Differentiable in `logits` only; its gradient has their dtype."""
    batch, n, vocab = target_logits.shape
    flat_rows = (rows + n * torch.arange(batch, device=rows.device)[:, None]).reshape(-1)
    share = torch.as_tensor(top1_share, dtype=torch.float32, device=logits.device).expand(rows.shape).reshape(-1)
    return _DistillCE.apply(logits, target_logits.reshape(batch * n, vocab).float(), flat_rows, share.contiguous())
