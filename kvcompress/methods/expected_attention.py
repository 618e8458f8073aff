"""ExpectedAttention: keep the tokens that future queries are expected to attend to.

Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from Future
Queries Distribution" (arXiv:2510.00636), as implemented by kvpress's ExpectedAttentionPress
(NVIDIA/kvpress, kvpress/presses/expected_attention_press.py). Future queries are modelled as
Gaussian, q ~ N(μ, Σ) per query head; then E[exp(s<q, k>)] = exp(s<μ, k> + s² kᵀΣk / 2), and a
token's score is this expected attention, normalised by softmax over the keys, averaged over the
query heads of its KV head, times ‖v‖ (`use_vnorm`).
"""

from dataclasses import dataclass

import torch

from ..checks import as_count, as_real, check_bool
from .base import ScoreMethod
from .registry import register
from .requirements import Requirements
from .tokens import Tokens


@register
@dataclass
class ExpectedAttention(ScoreMethod):
    """Score_i = mean over the GQA group of softmax_j(s<μ, k_j> + s² k_jᵀΣk_j / 2)_i, times (· + epsilon)·‖v_i‖.

    μ [B,H_q,d] and Σ [B,H_q,d,d] are the mean and covariance of the last `n_future_positions`
    queries given (Σ dropped with use_covariance=False); the softmax runs over every key, sink and
    window included. Departure from kvpress, which needs the model: kvpress takes pre-RoPE query
    statistics from the layer's hidden states and rotates them by the mean RoPE rotation of the
    next `n_future_positions` positions. Methods here see post-RoPE queries only, so the
    statistics come from the last `n_future_positions` post-RoPE queries, whose rotations average
    over a window of the same length just before the future one. kvpress's sink (4 tokens kept)
    is the framework's `sink` (default 4).

    n_future_positions: how many of the latest queries the statistics are taken from, an integer >= 1
    (default 512, kvpress's).
    use_covariance: include the s² kᵀΣk / 2 term (default True); False scores with the mean query alone.
    use_vnorm: multiply each score by ‖v‖ (default True).
    epsilon: a number >= 0 added to each softmax score before it is multiplied by ‖v‖ (default 0.0), so a
    token with a small score keeps a share of its value norm. It acts only through that product: a
    non-zero epsilon with use_vnorm=False is refused (adding a constant to every score changes no ranking).
    """

    name = "expected_attention"
    requirements = Requirements(inputs={"queries"})
    n_future_positions: int = 512
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self):
        self.n_future_positions = as_count("n_future_positions", self.n_future_positions, 1)
        for field in ("use_covariance", "use_vnorm"):
            check_bool(field, getattr(self, field))
        self.epsilon = as_real("epsilon", self.epsilon, "added to each score before it is scaled by the value norm", minimum=0.0)
        if self.epsilon and not self.use_vnorm:
            raise ValueError(f"epsilon={self.epsilon!r} is added to the scores before the value-norm scaling, which "
                             "use_vnorm=False leaves out (a constant added to every score changes no ranking): drop epsilon, "
                             "or use use_vnorm=True")

    @property
    def queries_read(self) -> int:
        return self.n_future_positions

    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        queries = tokens.queries[:, :, -self.n_future_positions :].float()
        b, hq, m, d = queries.shape
        hkv = tokens.keys.shape[1]
        group = hq // hkv
        s = tokens.scale
        keys = tokens.keys.float()
        if tokens.exact_keys is not None and tokens.exact_keys.shape[2]:  # no copy of every key for an empty exact set
            keys = torch.cat([keys, tokens.exact_keys.float()], 2)
        n = keys.shape[2]
        grouped = queries.reshape(b, hkv, group, m, d)
        mean = grouped.mean(dim=3)  # [B, H_kv, group, d]
        logits = torch.matmul(keys, s * mean.transpose(-1, -2))  # s<μ, k>: [B, H_kv, n, group]
        if self.use_covariance:
            # + s²/2 kᵀΣk = <k, s²/2 Σk>: Σk for the whole group in one GEMM per KV head.
            centred = grouped - mean.unsqueeze(3)
            cov = torch.matmul(centred.transpose(-1, -2), centred) / m  # [B, H_kv, group, d, d]
            stacked = (0.5 * s * s) * cov.permute(0, 1, 3, 2, 4).reshape(b, hkv, d, group * d)
            logits += torch.einsum("bhngd,bhnd->bhng", torch.matmul(keys, stacked).view(b, hkv, n, group, d), keys)
        scores = logits.softmax(dim=2)[:, :, : tokens.length].mean(dim=-1)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * tokens.values.float().norm(dim=-1)
        return scores
