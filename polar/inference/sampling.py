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


def processed_logprobs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
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
    may live on any device; on the CPU, deciding whether any row truncates costs no device sync.
    """
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    scale = torch.where(greedy, 1.0, temperature).to(logits.device, torch.float32)
    scaled = logits / scale.unsqueeze(-1)
    # 0 (or >= V) means no top-k; top_p outside (0, 1) means no nucleus; greedy ignores both.
    k = torch.where(greedy | (top_k <= 0) | (top_k >= vocab), 0, top_k)
    p = torch.where(greedy | (top_p <= 0) | (top_p >= 1), torch.inf, top_p.to(torch.float64))
    if bool((k > 0).any()) or bool(torch.isfinite(p).any()):
        scaled = _truncate(scaled, k.to(logits.device), p.to(logits.device))
    return scaled.log_softmax(-1)


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) what top-k, then top-p on the renormalised top-k distribution, drop.

    scaled [..., V]; top_k [...] (0 = keep all); top_p [...] fp64 (inf = keep all).
    """
    vocab = scaled.shape[-1]
    ordered = scaled.sort(dim=-1, descending=True).values  # [..., V]
    kth = ordered.gather(-1, (torch.where(top_k > 0, top_k, vocab) - 1).unsqueeze(-1))  # [..., 1]
    ordered = ordered.masked_fill(ordered < kth, -torch.inf)
    probs = ordered.softmax(-1)
    # Mass of the strictly earlier tokens; a shifted cumsum stays monotone, so `keep` is a prefix.
    before = F.pad(probs.cumsum(-1)[..., :-1], (1, 0)).to(torch.float64)  # [..., V]
    kept = (before < top_p.unsqueeze(-1)).sum(-1, keepdim=True)  # [..., 1], >= 1 as before[0] = 0
    # Past the top-k cut `ordered` holds -inf, so the top-k threshold still applies there.
    threshold = torch.maximum(kth, ordered.gather(-1, kept - 1))  # [..., 1]
    return scaled.masked_fill(scaled < threshold, -torch.inf)


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


def inverse_cdf(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token drawn by each row's uniform: logprobs [B, V], uniforms [B] in [0, 1) -> ids [B].

    Only tokens with positive probability can come out: the target stays strictly below the total
    mass, and the first cumulative sum above it ends on a token that added mass.
    """
    cdf = logprobs.to(torch.float64).exp().cumsum(-1)  # [B, V]
    total = cdf[:, -1:]  # [B, 1]
    target = torch.minimum(uniforms.to(cdf.device).unsqueeze(-1) * total, total.nextafter(total.new_zeros(())))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)


def sample_next_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row: logits [B, V] fp32; parameters [B] on the CPU; one generator a row.

    Returns (token ids [B], their logprobs [B] fp32), both on the logits' device. Greedy rows
    (temperature 0) take the argmax and draw nothing; sampling rows draw exactly one uniform from
    their own generator, so a row's tokens do not depend on the other rows of the batch.
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
            tokens = torch.where(greedy.to(logits.device), logits.argmax(-1), tokens)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
