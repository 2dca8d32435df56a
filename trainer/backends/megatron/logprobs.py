"""Per-token logprobs over a vocabulary split across tensor-parallel ranks; the full vocabulary is
never gathered.

Each rank holds logits [N, V/tp] for its vocabulary slice. log softmax(z / T)[target] needs two
numbers per row from the whole vocabulary: the logsumexp and the target's logit. Each rank computes
its slice's logsumexp and (where it owns the target) the target's scaled logit; one all-gather of
those [2, N] values gives every rank the global ones. The backward needs no communication:
d logprob / d z_j = (1[j = target] - softmax_j) / T, and softmax_j needs only the local z_j and
the global logsumexp, which forward kept. Like grpo.token_logprobs, the fp32 [rows, V/tp] work is
done a chunk of rows at a time and nothing of that size is kept for backward.

Logits may hold -inf where a constrained call's grammar refused a token (grpo.constrained_logits masks
each rank's slice first): a slice with no allowed token contributes a logsumexp of -inf, so the
softmax is over the masked, tempered vocabulary, and nothing to the gradient.

Only temperature is supported: top-k / top-p truncation keeps the tokens above a threshold found over
the whole vocabulary, so truncated sampling is refused with TruncatedSamplingError.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class TruncatedSamplingError(ValueError):
    """A token was sampled with top-k or top-p, which the vocabulary-parallel logprobs cannot reproduce."""


def check_untruncated(vocab_size: int, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """TruncatedSamplingError when a row was sampled (T > 0) with top-k or top-p truncation (the
    engine's rule, polar.inference.sampling: greedy rows never truncate)."""
    sampled = temperature > 0
    truncated = sampled & (((top_k > 0) & (top_k < vocab_size)) | ((top_p > 0) & (top_p < 1)))
    if bool(truncated.any()):
        count = int(truncated.sum())
        raise TruncatedSamplingError(
            f"{count} trainable tokens were sampled with top_k / top_p truncation; the megatron backend "
            "computes logprobs over a vocabulary split across ranks and supports temperature only. "
            "Sample training tasks with top_k = 0 and top_p = 1, or train with the torch backend."
        )


class _VocabParallelTemperedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, vocab_start, valid_columns, group, chunk_rows):
        # logits [N, Vl] (this rank's slice, any float dtype); targets [N] global ids; temperature [N] > 0
        rows = logits.shape[0]
        local = torch.empty(2, rows, dtype=torch.float32, device=logits.device)  # [logsumexp; target logit]
        local_targets = targets - vocab_start  # [N]
        owned = (local_targets >= 0) & (local_targets < valid_columns)  # [N]
        safe_targets = torch.where(owned, local_targets, 0)
        if valid_columns == 0:  # a slice of padding only: it adds nothing to either number
            local[0], local[1] = -torch.inf, 0.0
        for start in range(0, rows if valid_columns else 0, chunk_rows):
            chunk = slice(start, start + chunk_rows)
            scaled = logits[chunk, :valid_columns].float() / temperature[chunk, None]  # [C, Vl]
            local[0, chunk] = scaled.logsumexp(-1)
            local[1, chunk] = torch.where(owned[chunk], scaled.gather(-1, safe_targets[chunk, None]).squeeze(-1), 0.0)
        size = dist.get_world_size(group) if group is not None else 1
        if size > 1:
            gathered = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(gathered, local, group=group)
            stacked = torch.stack(gathered)  # [tp, 2, N]
            logsumexp = stacked[:, 0].logsumexp(0)  # [N]
            picked = stacked[:, 1].sum(0)  # [N]: exactly one rank owns each target
        else:
            logsumexp, picked = local[0], local[1]
        ctx.save_for_backward(logits, safe_targets, owned, temperature, logsumexp)
        ctx.valid_columns, ctx.chunk_rows = valid_columns, chunk_rows
        return picked - logsumexp

    @staticmethod
    def backward(ctx, grad_logprobs):
        logits, safe_targets, owned, temperature, logsumexp = ctx.saved_tensors
        valid = ctx.valid_columns
        grad_logits = torch.zeros_like(logits)  # padded vocabulary columns get 0
        for start in range(0, logits.shape[0] if valid else 0, ctx.chunk_rows):
            chunk = slice(start, start + ctx.chunk_rows)
            scaled = logits[chunk, :valid].float() / temperature[chunk, None]  # [C, Vl]
            grad = (scaled - logsumexp[chunk, None]).exp_().neg_()  # [C, Vl] = -softmax
            grad.scatter_add_(-1, safe_targets[chunk, None], owned[chunk, None].to(grad.dtype))
            grad *= (grad_logprobs[chunk] / temperature[chunk])[:, None]
            grad_logits[chunk, :valid] = grad
        return grad_logits, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group=None,
    chunk_rows: int = 1024,  # Qwen3's 152k vocabulary: 0.6 GB per fp32 temporary at TP=1
) -> torch.Tensor:
    """fp32 [N] log softmax(logits / T)[target] over the whole (unpadded) vocabulary; differentiable.

    logits [N, V/tp]: this rank's slice, starting at global id `vocab_start`; columns at or past
    `vocab_size` (the padding of the last slices) are left out. temperature [N]: 0 (greedy) means 1,
    as in the engine's contract. `group`: the tensor-parallel process group (None: one rank).
    """
    valid_columns = max(0, min(logits.shape[1], vocab_size - vocab_start))
    scale = torch.where(temperature > 0, temperature, 1.0).to(device=logits.device, dtype=torch.float32)
    targets = targets.to(device=logits.device, dtype=torch.long)
    return _VocabParallelTemperedLogprob.apply(logits, targets, scale, vocab_start, valid_columns, group, chunk_rows)
