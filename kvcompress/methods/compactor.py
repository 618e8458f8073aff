"""Compactor: approximate leverage scores of pre-RoPE keys blended with chunked non-causal attention.

Chari & Van Durme, "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate
Leverage Scores", arXiv:2507.08143 (Alg. 1, Sec. 3.1-3.4, App. C/D). The context-calibrated
choice of the ratio (Sec. 3.5; docs/design.md, "Context-calibrated compression") is
`kvcompress.calibration`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import LOG2_E, exp_rows_, log2_range, totals_in_range
from ..checks import as_count, as_real, check_bool
from ..saved_state import saved
from ..summary import KVSummary, take_slots
from .base import BlockwiseState, Method, StreamState, keep_top, top_index
from .registry import register
from .requirements import Requirements
from .tokens import Tokens

LEVERAGE_ROUTES = ("sketch", "exact", "qr", "eig")
SKETCHES = ("gaussian", "srht")
# Relative floor on the squared singular values of the sketched keys (the paper's App. C: eps ~ 1e-6),
# taken relative to the largest so it means the same for any key scale.
_SIGMA2_FLOOR = 1e-6


def hadamard(n: int, device=None) -> torch.Tensor:
    """[n, n] Walsh-Hadamard matrix with +-1 entries (Sylvester construction; n a power of two)."""
    h = torch.ones(1, 1, device=device, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def sketch_matrix(d: int, p: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """[d, p'] right sketch Phi (float32).

    gaussian: entries N(0, 1/p), p' = p (the paper's Alg. 1). srht: sqrt(1/p)·D·H·R (its App. D) with D
    random signs, H the Walsh-Hadamard matrix of the next power of two d' >= d (equivalent to
    zero-padding the keys to d' columns, which leaves leverage unchanged) and R p' = min(p, d')
    columns drawn without replacement. Applied as one GEMM: for head dims <= 256 a dense d x p
    product is as fast as the butterfly and keeps one code path.
    """
    device = generator.device
    if kind == "gaussian":
        return torch.randn(d, p, generator=generator, device=device, dtype=torch.float32) / math.sqrt(p)
    size = 1 << max(0, (d - 1).bit_length())
    signs = torch.randint(0, 2, (size,), generator=generator, device=device).float() * 2 - 1
    cols = torch.randperm(size, generator=generator, device=device)[: min(p, size)]
    return (signs[:, None] * hadamard(size, device)[:, cols])[:d] / math.sqrt(p)


def exact_leverage(keys: torch.Tensor) -> torch.Tensor:
    """[B,H,n] exact leverage ||U_i||^2 of each row of keys [B,H,n,d] (thin SVD in float64, rank-truncated)."""
    u, s, _ = torch.linalg.svd(keys.double(), full_matrices=False)
    tol = s[..., :1] * max(keys.shape[-2:]) * torch.finfo(torch.float64).eps
    return (u.pow(2) * (s > tol)[..., None, :]).sum(-1).float()


def leverage_scores(keys: torch.Tensor, route: str, sketch: str, sketch_dim: int, generator: torch.Generator) -> torch.Tensor:
    """[B,H,n] (approximate) leverage scores of keys [B,H,n,d], computed in float32.

    route "sketch" (the paper's Alg. 1): K^ = K·Phi, G = K^T K^ (p x p), SVD(G) = V S^2 V^T,
    U~ = K^ V S^-1, o_i = ||U~_i||^2 with S^2 floored at 1e-6 of its largest entry. K^ is never
    formed: G = Phi^T (K^T K) Phi and U~ = K (Phi V S^-1), two n-row products instead of three
    (the same scores up to float32 rounding). "qr": o_i =
    ||Q_i||^2 of the reduced QR of K^ (not rank-revealing: with sketch_dim above the keys' rank it
    also counts the spurious directions). "eig": eigh of G instead of its SVD (the least stable route,
    the paper's App. C). "exact": leverage of K itself (no sketch).
    """
    if route == "exact":
        return exact_leverage(keys)
    k = keys.float()
    phi = sketch_matrix(keys.shape[-1], sketch_dim, sketch, generator).to(keys.device)
    if route == "qr":
        return torch.linalg.qr(k @ phi).Q.pow(2).sum(-1)
    gram = phi.T @ (k.transpose(-1, -2) @ k) @ phi
    if route == "eig":
        sigma2, basis = torch.linalg.eigh(gram)
    else:
        basis, sigma2, _ = torch.linalg.svd(gram)
    sigma2 = torch.maximum(sigma2, _SIGMA2_FLOOR * sigma2.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny))
    u = k @ (phi @ (basis * sigma2.rsqrt()[..., None, :]))
    return u.square_().sum(-1)


def chunked_noncausal_attention(queries: torch.Tensor, keys: torch.Tensor, scale: float, chunk_size: int) -> torch.Tensor:
    """[B,H_kv,n]: column sums of non-causal softmax(s·Q[c] K[c]^T) within chunks of `chunk_size` tokens (the paper's Eq. 5).

    queries [B,H_q,n,d] are the queries of the same n tokens as keys [B,H_kv,n,d]; scores are
    averaged over the query heads of each KV group. One chunk at a time, its H_q x C x C logits in
    one reused workspace (2.25 MiB for 9 query heads and C = 256): memory never grows like n^2, and no
    copy of the queries is made (float32 queries are read in place). The rows are exponentiated
    unshifted and the call redone shifted if a row's total leaves float32's safe range
    (`exp_rows_`, one host read per call).
    """
    b, hq, n, d = queries.shape
    hkv = keys.shape[1]
    group = hq // hkv
    chunk_size = min(chunk_size, n)  # fewer tokens than a chunk: one chunk of n
    q = queries.float().unflatten(1, (hkv, group))  # [B, H_kv, group, n, d]
    k = keys.float() * (scale * LOG2_E)  # [B, H_kv, n, d]: one key head for its group, base-2 logits (`exp_rows_`)
    sums, total_range = _chunk_column_sums(q, k, chunk_size, shifted=False)
    if not totals_in_range(total_range):
        sums, _ = _chunk_column_sums(q, k, chunk_size, shifted=True)
    return sums.div_(group)


def _chunk_column_sums(q: torch.Tensor, k: torch.Tensor, chunk_size: int, shifted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(column sums [B,H_kv,n] of each chunk's softmax rows, summed over the group; the largest |log2| of a
    row's total) for q [B,H_kv,group,n,d] and scaled keys k [B,H_kv,n,d] (`chunked_noncausal_attention`). A chunk's
    queries of one KV group are the rows of one matrix (a copy of group x chunk_size rows), so each KV head's
    logits are one product."""
    b, hkv, group, n, d = q.shape
    out = torch.empty(b, hkv, n, device=q.device, dtype=q.dtype)
    workspace = torch.empty(b * hkv * group * chunk_size * chunk_size, device=q.device, dtype=q.dtype)
    total_range = torch.zeros((), device=q.device, dtype=q.dtype)
    for lo in range(0, n, chunk_size):
        hi = min(n, lo + chunk_size)
        rows = group * (hi - lo)
        logits = workspace[: b * hkv * rows * (hi - lo)].view(b, hkv, rows, hi - lo)
        torch.matmul(q[..., lo:hi, :].reshape(b, hkv, rows, d), k[..., lo:hi, :].transpose(-1, -2), out=logits)
        probs, inverse = exp_rows_(logits, shifted)
        torch.matmul(inverse.transpose(-1, -2), probs, out=out[:, :, lo:hi].unsqueeze(2))
        total_range = torch.maximum(total_range, log2_range(inverse))
    return out, total_range


# A spread this small beside a row's largest magnitude is float32 rounding, not a ranking: the leverage scores of keys
# of full row rank (no more tokens than the head dimension) are all 1 in exact arithmetic and come out 1 ± 1e-6, and
# standardising that noise would rank tokens by it (differently for each sketch drawn).
CONSTANT_SPREAD = 1e-4


def standardise(x: torch.Tensor) -> torch.Tensor:
    """(x - mean) / std along the token axis, per head; a row constant up to rounding (std at most `CONSTANT_SPREAD` of its
    largest |x|) maps to 0."""
    x = x.float()
    std = x.std(dim=-1, keepdim=True, unbiased=False)
    constant = std <= CONSTANT_SPREAD * x.abs().amax(dim=-1, keepdim=True)
    return torch.where(constant, 0.0, (x - x.mean(dim=-1, keepdim=True)) / std.clamp_min(1e-12))


DEFAULT_LEVERAGE_WEIGHT = 0.3  # the paper's lambda


@register
@dataclass
class Compactor(Method):
    """Keep the top-`budget` tokens per head by s = z(a) + leverage_weight·z(o) (the paper's Eq. 6).

    o: leverage scores of the pre-RoPE keys (`leverage` route "sketch" | "exact" | "qr" | "eig",
    `sketch` "gaussian" | "srht", `sketch_dim` k = 64). a: non-causal attention of each token's own
    chunk of `chunk_size` = 256 tokens (column sums, GQA-averaged), mean-pooled over
    `kernel_size` = 7 tokens as SnapKV does, times ||v|| (the paper's Sec. 3.3). `attention=False` is the
    paper's "no a" ablation (s = z(o), no queries needed); it takes no `leverage_weight`, which
    would only rescale z(o) and so change nothing (an error rather than a silently ignored value), nor a
    `chunk_size` or `kernel_size` other than the defaults; `leverage="exact"` takes no `sketch` or `sketch_dim`.
    Defaults follow the paper: lambda 0.3 (None means that, with the attention term), k 64, C 256,
    and every token is scored (sink = window = 0).

    Ranges: leverage_weight a number >= 0, or None (the default, meaning 0.3); sketch_dim and chunk_size
    integers >= 1; kernel_size an odd integer >= 1 (centred pooling); leverage defaults to "sketch", sketch
    to "gaussian", attention to True.

    Queries: a token's attention score uses the queries of its own chunk, so the queries of the
    tokens being compressed must be given (`query_positions` must cover their positions). In a
    model the prefill supplies them; the question is never seen (query-agnostic).

    Streaming: each block is attention-scored when it arrives (the score of a token depends only
    on its chunk, chunks restart at each block), the raw a of every held token is stored beside
    it, and at each re-compression (once the buffer is full, `BlockwiseState`: a block that does not fit is
    taken in pieces, scored as a whole on arrival) leverage is recomputed over the held pre-RoPE keys and both scores are
    re-standardised. With blocks that are multiples of `chunk_size`, the one-block case is the
    one-shot algorithm.
    """

    name = "compactor"
    randomized = True  # the Gaussian/SRHT sketch (leverage="exact" uses none, and is seed-independent)

    default_sink = 0
    default_window = 0
    leverage_weight: float | None = None
    leverage: str = "sketch"
    sketch: str = "gaussian"
    sketch_dim: int = 64
    chunk_size: int = 256
    kernel_size: int = 7
    attention: bool = True

    @property
    def requirements(self) -> Requirements:
        """Pre-RoPE keys, and the tokens' own queries for the attention term (none with attention=False)."""
        return Requirements(inputs={"queries", "pre_rope_keys"} if self.attention else {"pre_rope_keys"})

    def __post_init__(self):
        if self.leverage not in LEVERAGE_ROUTES:
            raise ValueError(f"leverage must be one of {LEVERAGE_ROUTES}, got {self.leverage!r}")
        if self.sketch not in SKETCHES:
            raise ValueError(f"sketch must be one of {SKETCHES}, got {self.sketch!r}")
        self.sketch_dim = as_count("sketch_dim", self.sketch_dim, 1)
        self.chunk_size = as_count("chunk_size", self.chunk_size, 1)
        self.kernel_size = as_count("kernel_size", self.kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (centred pooling), got {self.kernel_size}")
        check_bool("attention", self.attention)
        if self.leverage_weight is not None and not self.attention:
            raise ValueError(
                f"leverage_weight={self.leverage_weight!r} weighs leverage against the attention term, which attention=False "
                "leaves out (the score is then z(o) alone): drop leverage_weight, or use attention=True"
            )
        if self.leverage_weight is None:
            self.leverage_weight = DEFAULT_LEVERAGE_WEIGHT
        self.leverage_weight = as_real("leverage_weight", self.leverage_weight, "the weight of the leverage term", minimum=0.0)
        unused = [f"{name}={getattr(self, name)!r}" for name, used in (
            ("chunk_size", self.attention), ("kernel_size", self.attention),
            ("sketch", self.leverage != "exact"), ("sketch_dim", self.leverage != "exact"))
            if not used and getattr(self, name) != Compactor.__dataclass_fields__[name].default]
        if unused:
            raise ValueError(f"{', '.join(unused)} cannot act with attention={self.attention!r}, leverage={self.leverage!r} "
                             "(chunk_size and kernel_size shape the attention term; sketch and sketch_dim the sketched "
                             "leverage, which leverage='exact' does not use): drop them")
        self.reads_keys_values = self.attention  # without the attention term the score reads pre-RoPE keys only

    def check_stream_window(self, window: int) -> None:
        """The attention term scores a token with its own query, which a stream hands only with the token's block:
        a token that waits in the exact window has lost it by the time it is compressed."""
        if self.attention and window > 0:
            raise ValueError(f"window={window}: method 'compactor' scores each token with its own query, which a stream (mode "
                             "'chunked' or 'decode', kvc.stream) hands only with the token's block, so its exact window must be 0; "
                             "use window=0, or attention=False")

    def check_inputs(self, tokens: Tokens) -> None:
        if self.attention and tokens.queries is None:
            raise ValueError("method 'compactor' scores tokens with their own queries: pass queries=[B, H_q, n, d] (or attention=False)")
        if self.attention:
            own_queries(tokens)  # every token's own query, checked before a stream takes the block in
        if tokens.pre_rope_keys is None and tokens.unrotate is None:
            raise ValueError("method 'compactor' scores pre-RoPE keys: pass pre_rope_keys=[B, H_kv, n, d]")

    def attention_scores(self, tokens: Tokens) -> torch.Tensor:
        """[B,H_kv,n]: pooled, value-norm-scaled non-causal chunk attention of the tokens (their own queries); empty for
        no tokens (a stream state's kept scoring context, `Tokens.scoring_context`)."""
        if tokens.length == 0:
            return tokens.keys.new_zeros(tokens.keys.shape[:3], dtype=torch.float32)
        a = chunked_noncausal_attention(own_queries(tokens), tokens.keys, tokens.scale, self.chunk_size)
        b, h, n = a.shape
        pooled = F.avg_pool1d(a.reshape(b * h, 1, n), self.kernel_size, stride=1, padding=self.kernel_size // 2, count_include_pad=False)
        return pooled.reshape(b, h, n) * tokens.values.float().norm(dim=-1)

    def blend(self, attention: torch.Tensor | None, pre_rope_keys: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """[B,H_kv,n]: z(a) + lambda·z(o), or z(o) without the attention term."""
        outlier = standardise(leverage_scores(pre_rope_keys, self.leverage, self.sketch, self.sketch_dim, generator))
        if attention is None:
            return outlier
        return standardise(attention) + self.leverage_weight * outlier

    def compress(self, tokens: Tokens, budget: int, generator: torch.Generator) -> KVSummary:
        """One-shot: the top `budget` tokens per head by the blended score (the one-block stream, without its buffer)."""
        self.check_inputs(tokens)
        if tokens.length <= budget:
            return tokens.exact()
        return keep_top(tokens, self.score(tokens, generator), budget)

    def score(self, tokens: Tokens, generator: torch.Generator) -> torch.Tensor:
        """[B,H_kv,n]: the blended score of every token (higher is kept)."""
        return self.blend(self.attention_scores(tokens) if self.attention else None, tokens.pre_rope(), generator)

    def new_stream(self, budget: int, generator: torch.Generator, slack: float | None = None) -> StreamState:
        return CompactorState(self, budget, generator, self.stream_slack(slack))


def own_queries(tokens: Tokens) -> torch.Tensor:
    """[B,H_q,n,d]: the query of each token, matched by position; a clear error if any is missing."""
    pos = tokens.positions[0, 0]
    qpos = tokens.query_positions
    if qpos is not None:
        qpos = qpos.to(pos.device)
        if qpos.numel() == pos.numel():  # both ascending: every token has its query only if they are equal
            if torch.equal(qpos, pos):
                return tokens.queries  # the queries of exactly these tokens (a stream's block): no copy
        else:
            index = torch.searchsorted(qpos, pos).clamp_max(qpos.numel() - 1)
            if torch.equal(qpos[index], pos):
                return tokens.queries[:, :, index]
    raise ValueError(
        "compactor's attention term needs the query of every token it compresses (queries aligned with the "
        f"keys' positions {pos[0].item()}..{pos[-1].item()}); pass queries for all of them, or use attention=False"
    )


@saved("compactor_state", 2)
class CompactorState(BlockwiseState):
    """Kept tokens with their pre-RoPE keys (unless `Tokens.unrotate` recomputes them) and raw attention
    scores, re-compressed to the stream's target with amortised slack, within `budget` (`BlockwiseState`): leverage and both
    standardisations are recomputed only at a re-compression, over everything held."""

    def columns(self, tokens: Tokens) -> tuple[torch.Tensor, ...]:
        """keys, values, positions, pre-RoPE keys (see `BlockwiseState.columns`), and the raw attention score a
        of each token (scored on arrival)."""
        self.method.check_inputs(tokens)
        base = super().columns(tokens)
        return (*base, self.method.attention_scores(tokens)) if self.method.attention else base

    def keep(self, held: Tokens) -> tuple[torch.Tensor, ...]:
        columns = self.slots.view()
        scores = self.method.blend(columns[-1] if self.method.attention else None, held.pre_rope_keys, self.generator)
        index = top_index(scores, self.target)
        return tuple(take_slots(t, index) for t in columns)
