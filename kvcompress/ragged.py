"""Ragged storage of kept slots: each head stores only the slots it keeps (docs/design.md, "Memory").

A summary whose heads keep different numbers of slots (AdaKV's head-wise budgets; any summary with
empty slots, log-weight -inf) is rectangular for attention: `KVSummary` pads the shorter heads with
empty slots up to the longest. Stored that way, a layer would hold (longest head) x (heads) slots.
`RaggedSummary` stores the real slots only, packed head after head:

- keys [T, d], values [T, d_v]: the T real slots of every (batch row, head), row-major: the slots of
  head (b, h) follow those of (b, h - 1), each head's in their order in the summary;
- positions [T] int32 and log_weights [T] float32 (None when every real slot has weight 0);
- counts [B, H] int32: how many slots each head keeps (where its run starts follows from them).

So the stored bytes are the sum over heads of what each keeps, plus 4 bytes per head for its count.
`summary()` unpacks into the padded `KVSummary` attention reads (every head's slots first, then
empty slots up to the longest head): a transient, rebuilt at each read, as `QuantizedSummary`
dequantizes its codes; it is not stored, so it is not counted. A normalizer has no packed form: a
summary with one stays a `KVSummary` (`RaggedSummary.of` refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .saved_state import Maybe, Saveable, Tensor, saved
from .summary import KVSummary, concat


def has_empty_slots(summary: KVSummary) -> bool:
    """Whether `summary` has slots of log-weight -inf (empty, padding) and no normalizer: it stores fewer bytes
    as a `RaggedSummary` (one host sync; false at once for an eviction-only summary)."""
    if summary.eviction_only or summary.normalizer is not None:
        return False
    return bool(torch.isneginf(summary.log_weights).any())


def int32_positions(positions: torch.Tensor) -> torch.Tensor:
    """positions as the int32 a ragged summary stores; a ValueError for a position that does not fit (a host sync)."""
    if positions.numel() and int(positions.max()) > torch.iinfo(torch.int32).max:
        raise ValueError(f"positions up to {int(positions.max())} do not fit the int32 a ragged summary stores them in")
    return positions.to(torch.int32)


class PackedByHead:
    """What slots packed head after head tell of their layout, from the class's `counts` [B, H] (slots per head) and
    `log_weights` (None: every weight 0), each read from the device once: `RaggedSummary` and its quantized form."""

    @cached_property
    def num_slots(self) -> int:
        """Slots per head of the unpacked summary: the most any head keeps."""
        return int(self.counts.max()) if self.counts.numel() else 0

    @cached_property
    def run_counts(self) -> list[int]:
        """`counts` flattened into a list: the slots of each (batch row, head) run, in packed order."""
        return self.counts.flatten().tolist()

    @cached_property
    def _uniform(self) -> bool:
        """Every head keeps the same number of slots (the unpacked summary has no empty slot)."""
        return bool((self.counts == self.num_slots).all())

    @property
    def eviction_only(self) -> bool:
        """Whether the unpacked summary is eviction-only: every weight 0 and no empty slot."""
        return self.log_weights is None and self._uniform

    def _slots(self) -> torch.Tensor:
        """[T]: where each packed slot goes in the unpacked [B·H·num_slots] slot axis (its head's run, from the start)."""
        head, within = packed_heads(self.counts)
        return head * self.num_slots + within

    def unpacked(self, column: torch.Tensor, fill: float, slots: torch.Tensor | None = None) -> torch.Tensor:
        """A packed column [T, ...] as [B, H, m, ...]: each head's slots first, then `fill` up to the longest head m.
        slots: `_slots()`, when the caller has it already."""
        b, h = self.counts.shape
        out = column.new_full((b * h * self.num_slots, *column.shape[1:]), fill)
        out.index_copy_(0, self._slots() if slots is None else slots, column)
        return out.view(b, h, self.num_slots, *column.shape[1:])

    def check_counts(self) -> None:
        """A ValueError unless the per-head counts are non-negative and add up to the packed slots (the positions')."""
        total = self.positions.shape[0]
        if bool((self.counts < 0).any()) or int(self.counts.sum()) != total:
            raise ValueError(f"per-head counts must be non-negative and add up to the {total} packed slots")

    def with_layout_of(self, other: "PackedByHead"):
        """self, given the layout `other` (of the same counts) has read already: for a packing rebuilt at each read from
        a stored one (`QuantizedRaggedSummary.ragged`), so no read waits on the device for it."""
        self.__dict__.update(num_slots=other.num_slots, _uniform=other._uniform, run_counts=other.run_counts)
        return self


@saved("ragged_summary")
@dataclass(frozen=True)
class RaggedSummary(PackedByHead, Saveable):
    """A `KVSummary` without its empty slots, packed head after head (see the module docstring); immutable.

    keys [T, d], values [T, d_v] (T: the real slots of every batch row and head), log_weights [T]
    float32 or None (every real slot of weight 0), positions [T] int32, counts [B, H] int32 (real
    slots per head; they sum to T).
    """

    keys: torch.Tensor
    values: torch.Tensor
    log_weights: torch.Tensor | None
    positions: torch.Tensor
    counts: torch.Tensor

    saved_fields = {"keys": Tensor("T D"), "values": Tensor("T V"), "log_weights": Maybe(Tensor("T")),
                    "positions": Tensor("T", ("int32",)), "counts": Tensor("B H", ("int32",))}

    @classmethod
    def from_saved(cls, values):
        return cls(**values)

    def check_saved(self) -> None:
        self.check_counts()

    def __post_init__(self):
        total = self.keys.shape[0]
        if self.keys.ndim != 2 or self.values.ndim != 2 or self.values.shape[0] != total or self.positions.shape != (total,):
            raise ValueError(f"a RaggedSummary packs keys [T, d], values [T, d_v] and positions [T] of the same T, got keys "
                             f"{tuple(self.keys.shape)}, values {tuple(self.values.shape)}, positions {tuple(self.positions.shape)}")
        if self.log_weights is not None and self.log_weights.shape != (total,):
            raise ValueError(f"log_weights must be [T] = [{total}] or None, got {tuple(self.log_weights.shape)}")
        if self.counts.ndim != 2:
            raise ValueError(f"counts must be [B, H], got {tuple(self.counts.shape)}")

    @classmethod
    def of(cls, summary: KVSummary) -> "RaggedSummary":
        """`summary` packed: its slots of finite log-weight, head after head; the empty ones are not stored."""
        if summary.normalizer is not None:
            raise ValueError("a summary with a normalizer has no ragged form: store it as a KVSummary")
        real = torch.isfinite(summary.log_weights)
        weights = summary.log_weights[real].float()
        log_weights = None if bool((weights == 0).all()) else weights
        return cls(summary.keys[real], summary.values[real], log_weights, int32_positions(summary.positions[real]),
                   real.sum(-1).to(torch.int32))

    def padded(self, *packed: torch.Tensor, fill: float = 0.0) -> tuple[torch.Tensor, ...]:
        """(keys [B, H, m, d], values [B, H, m, d_v], positions [B, H, m] int64, then each of `packed` [T, ...] as
        [B, H, m, ...]): each head's slots first, then empty ones up to the longest head m, with zero keys and values,
        position -1 and `fill` in the extra columns."""
        slots = self._slots()
        columns = ((self.keys, 0), (self.values, 0), (self.positions.long(), -1), *((c, fill) for c in packed))
        return tuple(self.unpacked(column, value, slots) for column, value in columns)

    def summary(self) -> KVSummary:
        """The padded summary: each head's slots first, then empty ones (log-weight -inf, position -1, zero keys and
        values) up to the longest head; keys and values in the stored dtype, positions int64."""
        if self._uniform and self.log_weights is None:
            return KVSummary.exact(*self.padded())
        weights = (self.log_weights if self.log_weights is not None
                   else torch.zeros(self.keys.shape[0], device=self.keys.device, dtype=torch.float32))
        keys, values, positions, log_weights = self.padded(weights, fill=float("-inf"))
        return KVSummary(keys, values, log_weights, positions)

    def nbytes(self) -> int:
        """KV bytes stored: the packed keys and values, and the per-head counts that locate them (4 bytes per head)."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.counts))

    def index_nbytes(self) -> int:
        """Bytes of the packed positions and log-weights (none when every weight is 0)."""
        return sum(t.numel() * t.element_size() for t in (self.positions, self.log_weights) if t is not None)

    def select_rows(self, index: torch.Tensor) -> "RaggedSummary":
        """The batch rows `index` [k] (beam search), each row's packed run copied."""
        index = index.to(self.counts.device).long()
        elements = row_elements(self.counts, index)

        def pick(t):
            return t.index_select(0, elements) if t is not None else None

        return RaggedSummary(pick(self.keys), pick(self.values), pick(self.log_weights), pick(self.positions),
                             self.counts.index_select(0, index))

    def to(self, device, dtype: torch.dtype) -> "RaggedSummary":
        """Every tensor moved to `device`, keys and values cast to `dtype` (log-weights stay float32, positions and counts int32)."""
        log_weights = self.log_weights.to(device) if self.log_weights is not None else None
        return RaggedSummary(self.keys.to(device, dtype), self.values.to(device, dtype), log_weights, self.positions.to(device),
                             self.counts.to(device))


def packed_heads(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(head [T], within [T]) int64 for slots packed head after head by `counts` [B, H] (T: their sum): each packed
    slot's (batch row, head) as a flat index b·H + h, and its place in that head's run."""
    counts = counts.flatten().long()
    total = int(counts.sum())
    head = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=total)
    return head, torch.arange(total, device=counts.device) - (counts.cumsum(0) - counts)[head]


def row_elements(counts: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The packed elements (int64, as many as the rows' counts add up to) of batch rows `index` (int64, on counts'
    device) of a packing by `counts` [B, H], row after row in the order of `index` (a row may repeat), each row's run as
    it is packed."""
    per_row = counts.long().sum(-1)
    lengths = per_row.index_select(0, index)
    total = int(lengths.sum())
    row = torch.repeat_interleave(torch.arange(index.numel(), device=index.device), lengths, output_size=total)
    within = torch.arange(total, device=index.device) - (lengths.cumsum(0) - lengths)[row]
    return (per_row.cumsum(0) - per_row).index_select(0, index)[row] + within


def occupied_slots(part: KVSummary | RaggedSummary) -> torch.Tensor:
    """[B, H] int64: each head's slots of finite log-weight (a packed part stores only those: its counts), read
    without unpacking."""
    if isinstance(part, RaggedSummary):
        return part.counts.long()
    return torch.isfinite(part.log_weights).sum(-1)


def concat_parts(parts: list[KVSummary | RaggedSummary]) -> KVSummary:
    """`summary.concat` of summaries some of which are packed (`RaggedSummary`, as a layer stores AdaKV's kept tokens):
    each packed part unpacked (`summary()`) where it stands."""
    return concat([p.summary() if isinstance(p, RaggedSummary) else p for p in parts])
