"""The sampling distribution, shared by the inference engine and the trainer.

Generate's contract (protos/polar/v1/inference.proto) says the logprob of a sampled token is taken
over the exact distribution it was drawn from: log softmax(logits / T) in fp32 after top-k and top-p
truncation and renormalisation, with T = 1 and no truncation for greedy (temperature 0). The trainer
must compute the same quantity, so both call `processed_logprobs` / `batched_processed_logprobs`.

Truncation keeps every token whose scaled logit reaches a threshold value, so tied logits are kept or
dropped together and the result does not depend on how a sort orders ties (nor on batch layout).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`, copied without waiting for the work queued there.

    A plain copy to a GPU synchronises the host with the GPU's stream, so the host could not queue
    the next kernels while the current ones run; a copy from pinned memory is queued like a kernel
    (the caching host allocator keeps the pinned block until the copy has run).
    """
    if tensor.device == device:
        return tensor
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Log-probabilities a token is drawn with; logits [..., V] fp32 -> [..., V], masked = -inf."""
    lead = logits.shape[:-1]
    return batched_processed_logprobs(
        logits,
        torch.full(lead, float(temperature)),
        torch.full(lead, int(top_k), dtype=torch.long),
        torch.full(lead, float(top_p)),
    )


def batched_processed_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """`processed_logprobs` with per-row parameters.

    logits [..., V] fp32; temperature, top_k, top_p: [...] each (one value per row). The parameters
    may live on any device; on the CPU, choosing how much to sort costs no device sync.
    """
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    scale = to_device(torch.where(greedy, 1.0, temperature).to(torch.float32), logits.device)
    scaled = logits / scale.unsqueeze(-1)
    # 0 (or >= V) means no top-k; top_p outside (0, 1) means no nucleus; greedy ignores both.
    k = torch.where(greedy | (top_k <= 0) | (top_k >= vocab), vocab, top_k).reshape(-1)
    p = torch.where(greedy | (top_p <= 0) | (top_p >= 1), torch.inf, top_p.to(torch.float64)).reshape(-1)
    truncating = (k < vocab) | torch.isfinite(p)
    if bool(truncating.any()):
        # Only the rows that truncate pay for finding their most likely tokens.
        k, p = k[truncating], p[truncating]
        largest_k = int(torch.where(k < vocab, k, 1).max())
        candidates = min(vocab, max(largest_k, NUCLEUS_CANDIDATES if bool(torch.isfinite(p).any()) else 1))
        rows = to_device(truncating.nonzero().squeeze(-1), logits.device)
        flat = scaled.reshape(-1, vocab)  # a view: scaled is a fresh tensor
        flat[rows] = _truncate(flat[rows], to_device(k, logits.device), to_device(p, logits.device), candidates)
    return scaled.log_softmax(-1)


# Truncation first looks at this many most likely tokens of a row; a nucleus that is not complete
# within them (a flat distribution) makes that row look at its whole vocabulary.
NUCLEUS_CANDIDATES = 1024


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, candidates: int) -> torch.Tensor:
    """Mask (-inf) what top-k, then top-p on the renormalised top-k distribution, drop.

    scaled [N, V]; top_k [N] (V = keep all); top_p [N] fp64 (inf = keep all); every finite top_k is
    at most `candidates`, the number of most likely tokens examined.
    """
    vocab = scaled.shape[-1]
    ordered = scaled.topk(candidates, dim=-1).values  # [N, C], descending
    has_k = (top_k <= candidates).unsqueeze(-1)  # [N, 1]
    kth = torch.where(has_k, ordered.gather(-1, (top_k.clamp(max=candidates) - 1).unsqueeze(-1)), -torch.inf)
    in_top_k = scaled.masked_fill(scaled < kth, -torch.inf)  # [N, V]
    ordered = ordered.masked_fill(ordered < kth, -torch.inf)
    probs = (ordered - in_top_k.logsumexp(-1, keepdim=True)).exp()  # [N, C]
    # Mass of the strictly earlier tokens; a shifted cumsum stays monotone, so `within` is a prefix.
    before = F.pad(probs.cumsum(-1)[:, :-1], (1, 0)).to(torch.float64)  # [N, C]
    kept = (before < top_p.unsqueeze(-1)).sum(-1, keepdim=True)  # [N, 1], >= 1 as before[0] = 0
    nucleus = torch.isfinite(top_p).unsqueeze(-1)
    # Tied logits share a threshold, so they are kept or dropped together.
    threshold = torch.where(nucleus, torch.maximum(kth, ordered.gather(-1, kept - 1)), kth)  # [N, 1]
    truncated = in_top_k.masked_fill(scaled < threshold, -torch.inf)
    unfinished = (nucleus & ~has_k & (kept == candidates)).squeeze(-1)  # [N]
    if candidates < vocab and bool(unfinished.any()):
        rows = unfinished.nonzero().squeeze(-1)
        truncated[rows] = _truncate(scaled[rows], top_k[rows], top_p[rows], vocab)
    return truncated


def new_generator(seed: int | None) -> torch.Generator:
    """A request's own CPU random generator: seeded, or from a fresh random seed."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def draw_uniforms(generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One uniform in [0, 1) from each row's own generator -> [B] fp64 (CPU)."""
    if not generators:
        return torch.empty(0, dtype=torch.float64)
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])


# The inverse CDF first picks a block of this many tokens, then a token inside it: two short
# cumulative sums instead of one over the whole vocabulary, in fp32.
CDF_BLOCK = 256


def _below(target: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """target clamped strictly below total (so a search lands on something that added mass)."""
    return torch.minimum(target, total.nextafter(torch.zeros_like(total)))


def inverse_cdf(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token drawn by each row's uniform: logprobs [B, V], uniforms [B] in [0, 1) -> ids [B].

    Only tokens with positive probability can come out: each target stays strictly below the mass
    it searches, and the first cumulative sum above it ends on a block or token that added mass.
    """
    rows, vocab = logprobs.shape
    probs = logprobs.exp()
    if vocab % CDF_BLOCK:
        probs = F.pad(probs, (0, -vocab % CDF_BLOCK))
    blocks = probs.view(rows, -1, CDF_BLOCK)  # [B, nb, blk]
    block_cdf = blocks.sum(-1).cumsum(-1)  # [B, nb]
    uniforms = to_device(uniforms.to(block_cdf.dtype), block_cdf.device)
    target = _below(uniforms * block_cdf[:, -1], block_cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    block = torch.searchsorted(block_cdf, target, right=True)  # [B, 1]
    start = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), 0.0)  # [B, 1]
    inner_cdf = blocks.gather(1, block.unsqueeze(-1).expand(-1, -1, CDF_BLOCK)).squeeze(1).cumsum(-1)
    inner_target = _below(target - start, inner_cdf[:, -1:])  # [B, 1]
    return (block * CDF_BLOCK + torch.searchsorted(inner_cdf, inner_target, right=True)).squeeze(-1)


def sample_next_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: Sequence[torch.Generator],
    forced: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row: logits [B, V] fp32; parameters [B] on the CPU; one generator a row.

    Returns (token ids [B], their logprobs [B] fp32), both on the logits' device. Greedy rows
    (temperature 0) take the argmax and draw nothing; sampling rows draw exactly one uniform from
    their own generator, so a row's tokens do not depend on the other rows of the batch.
    `forced` [B] (CPU, -1 = sample): a row's token is taken as given instead (teacher forcing), with
    its logprob under the same distribution; -inf when the row's top-k / top-p truncation drops it.
    """
    logprobs = batched_processed_logprobs(logits, temperature, top_k, top_p)  # [B, V]
    greedy = temperature <= 0
    if bool(greedy.all()):
        tokens = logits.argmax(-1)
    else:
        sampling_rows = (~greedy).nonzero().squeeze(-1).tolist()
        uniforms = torch.zeros(len(generators), dtype=torch.float64)
        uniforms[sampling_rows] = draw_uniforms([generators[row] for row in sampling_rows])
        tokens = inverse_cdf(logprobs, uniforms)
        if bool(greedy.any()):
            tokens = torch.where(to_device(greedy, logits.device), logits.argmax(-1), tokens)
    if forced is not None:
        tokens = torch.where(to_device(forced >= 0, logits.device), to_device(forced, logits.device), tokens)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
