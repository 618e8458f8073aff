"""The one data model every method hands to attention (DESIGN.md §1)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class Normalizer:
    """A separate slot set used only for the softmax denominator.

    keys [B, H_kv, m, d], log_weights [B, H_kv, m], positions [B, H_kv, m] (original token index,
    used for causal masking). It replaces the whole denominator, so it must also hold every
    exactly-kept token with log-weight 0.
    """

    keys: torch.Tensor
    log_weights: torch.Tensor
    positions: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.log_weights, self.positions))


@dataclass
class KVSummary:
    """What a compressed layer hands to attention.

    keys [B, H_kv, n, d] (post-RoPE), values [B, H_kv, n, d_v], log_weights [B, H_kv, n]
    (log of how many original tokens a slot stands for; 0 for a kept token, -inf for an empty
    slot), positions [B, H_kv, n] (original token index, int64; -1 for empty slots),
    normalizer: optional separate denominator set.
    """

    keys: torch.Tensor
    values: torch.Tensor
    log_weights: torch.Tensor
    positions: torch.Tensor
    normalizer: Normalizer | None = None

    def __post_init__(self):
        b, h, n, _ = self.keys.shape
        if self.values.shape[:3] != (b, h, n):
            raise ValueError(f"values shape {tuple(self.values.shape)} does not match keys {tuple(self.keys.shape)}")
        if self.log_weights.shape != (b, h, n) or self.positions.shape != (b, h, n):
            raise ValueError(
                f"log_weights {tuple(self.log_weights.shape)} and positions {tuple(self.positions.shape)} "
                f"must both be {(b, h, n)}"
            )

    @classmethod
    def exact(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> "KVSummary":
        """Every token kept once: log-weights 0. positions [B, H_kv, n] or [n]."""
        b, h, n, _ = keys.shape
        positions = positions.to(device=keys.device, dtype=torch.long).expand(b, h, n)
        log_weights = torch.zeros(b, h, n, dtype=torch.float32, device=keys.device)
        return cls(keys, values, log_weights, positions)

    @classmethod
    def empty_like(cls, keys: torch.Tensor, values: torch.Tensor) -> "KVSummary":
        """A summary with no slots, with the batch, head, dim, dtype and device of keys/values."""
        b, h, _, d = keys.shape
        return cls(
            keys.new_zeros(b, h, 0, d),
            values.new_zeros(b, h, 0, values.shape[-1]),
            torch.zeros(b, h, 0, dtype=torch.float32, device=keys.device),
            torch.zeros(b, h, 0, dtype=torch.long, device=keys.device),
        )

    @property
    def num_slots(self) -> int:
        """Slots per head (including -inf padding)."""
        return self.keys.shape[2]

    def nbytes(self) -> int:
        """Bytes of every tensor the summary stores."""
        own = sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.log_weights, self.positions))
        return own + (self.normalizer.nbytes() if self.normalizer is not None else 0)

    def total_weight(self) -> torch.Tensor:
        """[B, H_kv]: the number of original tokens the numerator slots stand for."""
        return self.log_weights.double().exp().sum(-1)

    def as_normalizer(self) -> Normalizer:
        """This summary's own slots as a denominator set."""
        return Normalizer(self.keys, self.log_weights, self.positions)

    def denominator(self) -> Normalizer:
        """The set the softmax denominator runs over."""
        return self.normalizer if self.normalizer is not None else self.as_normalizer()

    def to(self, dtype: torch.dtype) -> "KVSummary":
        """Keys/values (and normalizer keys) cast to dtype; weights and positions unchanged."""
        norm = self.normalizer
        if norm is not None:
            norm = replace(norm, keys=norm.keys.to(dtype))
        return replace(self, keys=self.keys.to(dtype), values=self.values.to(dtype), normalizer=norm)


def concat(parts: list[KVSummary]) -> KVSummary:
    """Concatenate summaries along the slot axis (e.g. sink + compressed middle + window).

    If any part has a normalizer, the result's normalizer is every part's denominator set, so
    exactly-kept parts enter it with their own weights.
    """
    parts = [p for p in parts if p is not None]
    if not parts:
        raise ValueError("concat needs at least one summary")
    if len(parts) == 1:
        return parts[0]
    out = KVSummary(
        torch.cat([p.keys for p in parts], 2),
        torch.cat([p.values for p in parts], 2),
        torch.cat([p.log_weights for p in parts], 2),
        torch.cat([p.positions for p in parts], 2),
    )
    if any(p.normalizer is not None for p in parts):
        dens = [p.denominator() for p in parts]
        out.normalizer = Normalizer(
            torch.cat([d.keys for d in dens], 2),
            torch.cat([d.log_weights for d in dens], 2),
            torch.cat([d.positions for d in dens], 2),
        )
    return out


def gather_slots(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, index: torch.Tensor) -> tuple:
    """Per-head gather along the token axis.

    keys [B,H,n,d], values [B,H,n,dv], positions [B,H,n], index [B,H,k] -> (keys, values, positions) with k slots.
    """
    idx = index.unsqueeze(-1)
    k = keys.gather(2, idx.expand(*index.shape, keys.shape[-1]))
    v = values.gather(2, idx.expand(*index.shape, values.shape[-1]))
    p = positions.gather(2, index)
    return k, v, p
