"""The one data model every method hands to attention (docs/design.md, "One summary for every method")."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .checks import check_bool, check_positions, describe
from .saved_state import Count, Flag, Instance, Maybe, Saveable, Sequence, Tensor, saved


@saved("normalizer")
@dataclass
class Normalizer(Saveable):
    """A separate slot set used only for the softmax denominator.

    keys [B, H_kv, m, d], log_weights [B, H_kv, m], positions [B, H_kv, m] (original token index,
    used for causal masking). It replaces the whole denominator, so it must also hold every
    exactly-kept token with log-weight 0.
    """

    keys: torch.Tensor
    log_weights: torch.Tensor
    positions: torch.Tensor

    saved_fields = {"keys": Tensor("B H m D"), "log_weights": Tensor("B H m"), "positions": Tensor("B H m", ("int64",))}

    def nbytes(self) -> int:
        """Bytes of its keys (the KV data; see `KVSummary.nbytes`)."""
        return self.keys.numel() * self.keys.element_size()


@saved("kv_summary")
@dataclass
class KVSummary(Saveable):
    """What a compressed layer hands to attention.

    keys [B, H_kv, n, d] (post-RoPE), values [B, H_kv, n, d_v], log_weights [B, H_kv, n]
    (log of how many original tokens a slot stands for; 0 for a kept token, -inf for an empty
    slot), positions [B, H_kv, n] (original token index, int64; -1 for empty slots),
    normalizer: optional separate denominator set.

    eviction_only: the producer guarantees every log-weight is 0 (no -inf padding) and there is no
    normalizer, so attention needs no bias and can take the fastest kernel. It is known from how
    the summary was made, never read from the values on the hot path: `exact` and `empty_like`
    set it, `concat` keeps it when every part has it, `checked_eviction` reads it from the values
    once. The default False is always correct (the weights are then applied as a bias).
    """

    keys: torch.Tensor
    values: torch.Tensor
    log_weights: torch.Tensor
    positions: torch.Tensor
    normalizer: Normalizer | None = None
    eviction_only: bool = False

    saved_fields = {"keys": Tensor("B H n D"), "values": Tensor("B H n V"), "log_weights": Tensor("B H n"),
                    "positions": Tensor("B H n", ("int64",)), "normalizer": Maybe(Instance("normalizer")), "eviction_only": Flag()}

    @classmethod
    def from_saved(cls, values):
        """Built by the constructor, which checks the shapes agree."""
        return cls(**values)

    def check_saved(self) -> None:
        if self.eviction_only and not bool((self.log_weights == 0).all()):
            raise ValueError("eviction_only is set but some log-weights are not 0")

    def __post_init__(self):
        tensors = (self.keys, self.values, self.log_weights, self.positions)
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            name, t = next((n, t) for n, t in zip(("keys", "values", "log_weights", "positions"), tensors) if not isinstance(t, torch.Tensor))
            raise ValueError(f"{name} must be a tensor, got {describe(t)}")
        check_bool("eviction_only", self.eviction_only)
        if self.normalizer is not None:
            if not isinstance(self.normalizer, Normalizer):
                raise ValueError(f"normalizer must be a Normalizer or None, got {describe(self.normalizer)}")
            tensors += (self.normalizer.keys, self.normalizer.log_weights, self.normalizer.positions)
        device = self.keys.device
        if any(t.device != device for t in tensors):
            names = ("keys", "values", "log_weights", "positions", "normalizer.keys", "normalizer.log_weights", "normalizer.positions")
            raise ValueError(f"a summary's tensors must be on one device, got {', '.join(f'{n} on {t.device}' for n, t in zip(names, tensors))}")
        if self.eviction_only and self.normalizer is not None:
            raise ValueError("eviction_only=True needs normalizer=None: a normalizer reweights the denominator")
        if self.keys.ndim != 4 or self.values.ndim != 4:
            raise ValueError(f"keys and values must be 4-D [B, H_kv, n, d], got keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)}")
        b, h, n, _ = self.keys.shape
        if self.values.shape[:3] != (b, h, n):
            raise ValueError(f"values shape {tuple(self.values.shape)} does not match keys {tuple(self.keys.shape)}")
        if self.log_weights.shape != (b, h, n) or self.positions.shape != (b, h, n):
            raise ValueError(
                f"log_weights {tuple(self.log_weights.shape)} and positions {tuple(self.positions.shape)} "
                f"must both be {(b, h, n)}"
            )
        # dtypes only (no value is read: summaries are built on the decode path, where a read is a device sync)
        if not self.keys.is_floating_point() or self.values.dtype != self.keys.dtype or not self.log_weights.is_floating_point():
            raise ValueError(f"keys and values must share one floating dtype and log_weights be floating, got keys {self.keys.dtype}, "
                             f"values {self.values.dtype}, log_weights {self.log_weights.dtype}")
        if self.positions.dtype != torch.long:
            raise ValueError(f"positions must be int64 (each slot's token index, -1 for an empty slot), got {self.positions.dtype}")
        if self.normalizer is not None:
            norm = self.normalizer
            m = norm.keys.shape[2] if norm.keys.ndim == 4 else None
            if (norm.keys.ndim != 4 or norm.keys.shape[:2] != (b, h) or norm.keys.shape[3] != self.keys.shape[3]
                    or norm.log_weights.shape != (b, h, m) or norm.positions.shape != (b, h, m)):
                raise ValueError(
                    f"normalizer keys {tuple(norm.keys.shape)}, log_weights {tuple(norm.log_weights.shape)} and positions "
                    f"{tuple(norm.positions.shape)} must be [B, H_kv, m, d], [B, H_kv, m] and [B, H_kv, m] with the "
                    f"summary's B, H_kv and d {(b, h, self.keys.shape[3])}"
                )
            if not norm.keys.is_floating_point() or not norm.log_weights.is_floating_point() or norm.positions.dtype != torch.long:
                raise ValueError(f"normalizer keys and log_weights must be floating and its positions int64, got {norm.keys.dtype}, "
                                 f"{norm.log_weights.dtype} and {norm.positions.dtype}")

    @classmethod
    def exact(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> "KVSummary":
        """Every token kept once: log-weights 0, eviction_only. positions [B, H_kv, n] or [n].

        The log-weights are a broadcast view of one zero, so indexed or arithmetic writes into them
        raise instead of silently contradicting eviction_only (fill_ does not: never use it on
        these); build a new summary to reweight.
        """
        b, h, n, _ = keys.shape
        check_positions(positions, keys, ordered=False)
        positions = positions.to(device=keys.device, dtype=torch.long).expand(b, h, n)
        log_weights = torch.zeros(1, dtype=torch.float32, device=keys.device).expand(b, h, n)
        return cls(keys, values, log_weights, positions, eviction_only=True)

    @classmethod
    def empty_like(cls, keys: torch.Tensor, values: torch.Tensor) -> "KVSummary":
        """A summary with no slots, with the batch, head, dim, dtype and device of keys/values."""
        b, h, _, d = keys.shape
        return cls(
            keys.new_zeros(b, h, 0, d),
            values.new_zeros(b, h, 0, values.shape[-1]),
            torch.zeros(b, h, 0, dtype=torch.float32, device=keys.device),
            torch.zeros(b, h, 0, dtype=torch.long, device=keys.device),
            eviction_only=True,
        )

    @property
    def num_slots(self) -> int:
        """Slots per head (including -inf padding)."""
        return self.keys.shape[2]

    def nbytes(self) -> int:
        """KV bytes: its keys and values (and normalizer keys), the quantity a full cache's bytes count.

        Log-weights and positions (12 bytes per slot and head) are bookkeeping, counted apart by
        `index_nbytes`; docs/design.md ("Memory") explains the split."""
        own = sum(t.numel() * t.element_size() for t in (self.keys, self.values))
        return own + (self.normalizer.nbytes() if self.normalizer is not None else 0)

    def index_nbytes(self) -> int:
        """Bytes of its log-weights and positions (and the normalizer's)."""
        parts = [self.log_weights, self.positions]
        if self.normalizer is not None:
            parts += [self.normalizer.log_weights, self.normalizer.positions]
        return sum(t.numel() * t.element_size() for t in parts)

    def total_weight(self) -> torch.Tensor:
        """[B, H_kv]: the number of original tokens the numerator slots stand for."""
        return self.log_weights.double().exp().sum(-1)

    def as_normalizer(self) -> Normalizer:
        """This summary's own slots as a denominator set."""
        return Normalizer(self.keys, self.log_weights, self.positions)

    def denominator(self) -> Normalizer:
        """The set the softmax denominator runs over."""
        return self.normalizer if self.normalizer is not None else self.as_normalizer()

    def checked_eviction(self) -> "KVSummary":
        """This summary with eviction_only read from its values (one host sync: call once per
        compression, never per decode step)."""
        plain = self.normalizer is None and bool((self.log_weights == 0).all())
        return replace(self, eviction_only=plain)

    def clone(self) -> "KVSummary":
        """This summary in storage of its own (normalizer included): what is kept of a slice of a larger summary, which
        a view would keep alive whole."""
        norm = self.normalizer
        if norm is not None:
            norm = Normalizer(norm.keys.clone(), norm.log_weights.clone(), norm.positions.clone())
        return replace(self, keys=self.keys.clone(), values=self.values.clone(), log_weights=self.log_weights.clone(),
                       positions=self.positions.clone(), normalizer=norm)

    def to(self, dtype: torch.dtype, device: torch.device | str | None = None) -> "KVSummary":
        """Keys/values (and normalizer keys) cast to dtype, every tensor moved to device (if given);
        weights stay float32, positions int64."""
        norm = self.normalizer
        if norm is not None:
            norm = Normalizer(norm.keys.to(device, dtype), norm.log_weights.to(device), norm.positions.to(device))
        return replace(self, keys=self.keys.to(device, dtype), values=self.values.to(device, dtype),
                       log_weights=self.log_weights.to(device), positions=self.positions.to(device), normalizer=norm)


def check_joinable(parts: list[KVSummary]) -> None:
    """A ValueError unless the summaries share batch rows, KV heads, head dims, dtype and device (what `concat` joins)."""
    first = parts[0]
    for i, p in enumerate(parts[1:], 1):
        if (p.keys.shape[:2], p.keys.shape[3], p.values.shape[3], p.keys.dtype, p.values.dtype, p.keys.device) != (
                first.keys.shape[:2], first.keys.shape[3], first.values.shape[3], first.keys.dtype, first.values.dtype,
                first.keys.device):
            raise ValueError(
                f"concat's parts must share batch, KV heads, head dims, dtype and device: part 0 has keys "
                f"{describe(first.keys)} and values {describe(first.values)}, part {i} keys {describe(p.keys)} and "
                f"values {describe(p.values)}"
            )


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
    check_joinable(parts)
    out = KVSummary(
        torch.cat([p.keys for p in parts], 2),
        torch.cat([p.values for p in parts], 2),
        torch.cat([p.log_weights for p in parts], 2),
        torch.cat([p.positions for p in parts], 2),
        eviction_only=all(p.eviction_only for p in parts),
    )
    if any(p.normalizer is not None for p in parts):
        dens = [p.denominator() for p in parts]
        out.normalizer = Normalizer(
            torch.cat([d.keys for d in dens], 2),
            torch.cat([d.log_weights for d in dens], 2),
            torch.cat([d.positions for d in dens], 2),
        )
    return out


def split_exact_ends(summary: KVSummary, sink: int, window: int) -> tuple[KVSummary, KVSummary]:
    """(the slots between the first `sink` and the last `window`, those `sink` then `window` slots): a compressed
    summary's exact sink and window split off, for a store that keeps its compressed slots apart (packed or quantized)
    and the exact ones as they are.

    The sink's and the window's slots must be exact tokens (log-weight 0) that start and end the normalizer too, as
    `concat` leaves a sink concatenated first and a window last; the exact slots come back without a normalizer and
    eviction-only. Anything else is an error. The front is a view of the summary's tensors (the caller stores it
    packed or quantized); the exact slots are a copy, since they are kept as they are, and a view would keep the whole
    summary's storage alive beside them.
    """
    n = summary.num_slots
    if not (0 <= sink and 0 <= window and sink + window <= n):
        raise ValueError(f"sink and window must be counts of at most {n} slots together, got sink={sink}, window={window}")

    def ends(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:, :, :sink], t[:, :, t.shape[2] - window :]], 2)

    columns = (summary.keys, summary.values, summary.log_weights, summary.positions)
    front = KVSummary(*(t[:, :, sink : n - window] for t in columns), eviction_only=summary.eviction_only)
    exact = KVSummary(*map(ends, columns))
    ok = bool((exact.log_weights == 0).all())
    norm = summary.normalizer
    if norm is not None:
        m, denominator = norm.keys.shape[2], (norm.keys, norm.log_weights, norm.positions)
        ok = ok and m >= sink + window and torch.equal(ends(norm.positions), exact.positions) and bool((ends(norm.log_weights) == 0).all())
        front.normalizer = Normalizer(*(t[:, :, sink : m - window] for t in denominator))
    if not ok:
        raise ValueError("the first sink and last window slots of this summary are not exact tokens that start and end its "
                         "normalizer: no exact sink and window to split off")
    return front, replace(exact, eviction_only=True)


def take_slots(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B,H,n,...], index [B,H,k] -> [B,H,k,...]: per-head gather along the token axis, as one
    index_select over rows of the storage (cheaper on the CPU than `gather` with an expanded index)."""
    rows, head_rows, slot_rows = _slot_rows(x)
    flat = (index if slot_rows == 1 else index * slot_rows) + head_rows
    return rows.index_select(0, flat.flatten()).view(*index.shape, *x.shape[3:])


def _slot_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(rows [R, ...], head_rows [B,H,1], slot_rows): slot i of head (b, h) is row head_rows[b, h] + i·slot_rows.

    A view of the storage, no copy, whenever each slot's trailing block is contiguous and the batch,
    head and slot strides are whole slots: a contiguous tensor, the first n slots of a stream's
    [B,H,capacity,...] buffer, and the model's keys and values, which are [B,n,H,d] in memory (a
    transposed projection) or expanded over heads. Anything else is copied once by reshape."""
    b, h, n = x.shape[:3]
    tail = math.prod(x.shape[3:])
    strides = [stride if size > 1 else 0 for size, stride in zip(x.shape[:3], x.stride()[:3])]
    if x.is_contiguous() or not x.numel() or not x[0, 0, 0].is_contiguous() or any(s % tail for s in strides):
        sb, sh, sn = h * n, n, 1
        rows = x.reshape(b * h * n, *x.shape[3:])
    else:
        sb, sh, sn = (s // tail for s in strides)
        count = (b - 1) * sb + (h - 1) * sh + (n - 1) * sn + 1
        rows = x.as_strided((count, *x.shape[3:]), (tail, *x.stride()[3:]))
    if sb == h * sh or b == 1:  # heads evenly spaced through the batch: one arange
        head_rows = (torch.arange(b * h, device=x.device) * sh).view(b, h, 1)
    else:
        head_rows = (torch.arange(b, device=x.device) * sb).view(b, 1, 1) + (torch.arange(h, device=x.device) * sh).view(1, h, 1)
    return rows, head_rows, sn


def gather_slots(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, index: torch.Tensor) -> tuple:
    """Per-head gather along the token axis.

    keys [B,H,n,d], values [B,H,n,dv], positions [B,H,n], index [B,H,k] -> (keys, values, positions) with k slots.
    """
    return take_slots(keys, index), take_slots(values, index), take_slots(positions, index)


@saved("growing_slots")
class _GrowingSlots(Saveable):
    """Tensors [B, H, capacity, ...] filled along the slot axis; `append` writes in place and
    reallocates (one copy) only when full, with room for max(16, n/16) more slots (or up to
    `reserve` slots in all, when larger), never beyond `most` slots (when given) unless the slots
    themselves need more."""

    # every column [B, H, capacity, ...]: keys, values, positions and any other per-slot column
    saved_fields = {"tensors": Sequence(Tensor("B H c ...", ("float", "int64", "int32", "uint8")), kind="tuple"), "length": Count()}

    def __init__(self):
        self.tensors: tuple[torch.Tensor, ...] = ()
        self.length = 0

    def saved_values(self) -> dict:
        """The filled slots only: the room beyond them holds whatever memory it was allocated with, which a file must not
        carry (the same state then saves to the same bytes); a loaded state grows its room at its next append."""
        return {"tensors": self.view(), "length": self.length}

    def check_saved(self) -> None:
        if self.tensors and self.length > self.tensors[0].shape[2]:
            raise ValueError(f"length {self.length} is more than the {self.tensors[0].shape[2]} slots allocated")
        if not self.tensors and self.length:
            raise ValueError(f"length {self.length} with no tensors")

    def append(self, parts: tuple[torch.Tensor, ...], reserve: int = 0, most: int | None = None) -> None:
        need = self.length + parts[0].shape[2]
        if not self.tensors or need > self.tensors[0].shape[2]:
            capacity = max(need + max(16, need // 16), reserve)
            if most is not None:
                capacity = max(need, min(capacity, most))
            grown = tuple(p.new_empty(*p.shape[:2], capacity, *p.shape[3:]) for p in parts)
            for new, old in zip(grown, self.tensors):
                new[:, :, : self.length] = old[:, :, : self.length]
            self.tensors = grown
        for buffer, part in zip(self.tensors, parts):
            buffer[:, :, self.length : need] = part
        self.length = need

    def detach_(self) -> None:
        """Keep the tensors apart from any autograd graph an append under gradients tied them to (no copy)."""
        self.tensors = tuple(t.detach() for t in self.tensors)

    @property
    def width(self) -> int:
        """Columns stored."""
        return len(self.tensors)

    def view(self) -> tuple[torch.Tensor, ...]:
        return tuple(t[:, :, : self.length] for t in self.tensors)

    def kv_bytes(self) -> int:
        """Bytes allocated (room included) for the per-slot vectors [B,H,capacity,d]: keys, values, and any
        other key copies; per-slot scalars [B,H,capacity] (log-weights, positions, scores) are bookkeeping."""
        return sum(t.numel() * t.element_size() for t in self.tensors if t.ndim == 4)


class SlotBuffer:
    """A summary that grows by appending exact blocks in place: a cache layer's state once its
    context is compressed, so a decode step writes one token instead of copying the whole state.

    `summary()` is a view of the filled slots (no copy). Storage keeps headroom of at most
    max(16, n/16) slots, and never beyond `most` slots in all (a cache passes the tokens it has
    seen, so the allocation never exceeds a full cache's); `nbytes` counts the allocated keys and
    values (and normalizer keys), `index_nbytes` the log-weights and positions held.
    Appending follows `concat`: once a part has a normalizer, the denominator set is kept too
    (slots of parts without one enter it with their own weights).
    """

    def __init__(self, first: KVSummary, most: int | None = None):
        self.slots = _GrowingSlots()
        self.denominator: _GrowingSlots | None = None
        self.eviction_only = True
        self.append(first, most)

    def append(self, part: KVSummary, most: int | None = None) -> KVSummary:
        """Write part's slots after the stored ones (allocating at most `most` slots, see above); returns the whole summary (a view)."""
        if part.normalizer is not None and self.denominator is None and self.slots.length:
            self.denominator = _GrowingSlots()
            keys, _, log_weights, positions = self.slots.view()
            self.denominator.append((keys, log_weights, positions))
        self.slots.append((part.keys, part.values, part.log_weights, part.positions), most=most)
        if part.normalizer is not None and self.denominator is None:
            self.denominator = _GrowingSlots()
        if self.denominator is not None:
            den = part.denominator()
            self.denominator.append((den.keys, den.log_weights, den.positions), most=most)
        self.eviction_only = self.eviction_only and part.eviction_only
        return self.summary()

    def hide_last(self, hidden: torch.Tensor) -> None:
        """Log-weight -inf, in place, for the last hidden.shape[-1] slots where hidden [B, H_kv, n] is True: padding of the
        block just appended (a left-padded turn after a compressed context), never attended again."""
        n = hidden.shape[-1]
        for slots, log_weights in ((self.slots, 2), (self.denominator, 1)):
            if slots is not None:
                slots.tensors[log_weights][..., slots.length - n : slots.length].masked_fill_(hidden, float("-inf"))
        self.eviction_only = False

    def detach_(self) -> None:
        """Keep the stored slots apart from the autograd graph of a forward with gradients on, whose block `append` wrote
        in place (a stored state never holds a graph: a second backward would run through the first's)."""
        self.slots.detach_()
        if self.denominator is not None:
            self.denominator.detach_()

    def summary(self) -> KVSummary:
        keys, values, log_weights, positions = self.slots.view()
        normalizer = Normalizer(*self.denominator.view()) if self.denominator is not None else None
        return KVSummary(keys, values, log_weights, positions, normalizer, self.eviction_only and normalizer is None)

    def nbytes(self) -> int:
        return self.slots.kv_bytes() + (self.denominator.kv_bytes() if self.denominator is not None else 0)

    def index_nbytes(self) -> int:
        return self.summary().index_nbytes()
