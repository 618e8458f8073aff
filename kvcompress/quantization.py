"""Quantized storage of kept slots: keys per channel, values per token (docs/design.md, "Quantized storage").

The scheme is KIVI's ("KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv
2402.02750): asymmetric round-to-nearest with a scale and a zero point (the group's minimum) per
group; keys are grouped per channel over `group_size` consecutive slots (key outliers sit in a few
channels), values per slot over `group_size` consecutive channels. Codes of 2 and 4 bits are
packed four and two to a byte along the channel axis; 8-bit codes take a byte each. Scales and
zero points are stored in the summary's own dtype and the codes are rounded against the stored
(rounded) scale and zero point, so dequantization reproduces exactly what quantization aimed at.

Unlike KIVI, which quantizes a full cache, the slots here come from a compressed summary: slots
with log-weight -inf (empty slots, head-wise budget padding) are left out of the key groups'
ranges, and log-weights and positions (int32 here, int64 again when dequantized) stay exact.
Plain torch ops, no kernel: `QuantizedSummary.summary()` dequantizes the whole summary into a
`KVSummary` each time it is read, and `summary_then` straight into the view that attention reads at each
step, the exact slots after it.

A live stream (mode "decode") keeps re-selecting which slots it holds, so a per-channel key group
(G consecutive slots) would lose members at every re-compression and have to be quantized again,
compounding the rounding. `QuantizedSlots`, the storage of a block-wise stream, therefore groups
keys per slot too (G consecutive channels, as values): each slot is quantized once, when it enters
the stream, and a re-compression only selects stored codes. A native stream's state stores its
tensors row by row the same way (`quantize_rows`, used by `methods.base.QuantizedState`), a row it
already stored keeping its codes.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache

import torch
import torch.nn.functional as F

from .checks import as_count, describe
from .names import KV_BITS
from .ragged import PackedByHead, RaggedSummary, packed_heads, row_elements
from .saved_state import Choice, Count, Instance, Maybe, Record, Saveable, Tensor, saved
from .summary import KVSummary, Normalizer, _GrowingSlots, check_joinable, concat, take_slots

DEFAULT_GROUP_SIZE = 32
# The smallest group: 8-bit codes in groups of 8 with a bfloat16 scale and zero point take 1.5 bytes a value, against 2
# at full precision (groups of 4 would take 2, and the last, partial group of a run more)
MIN_GROUP_SIZE = 8
_AXES = ("channel", "token")


def check_kv_bits(bits) -> int | None:
    """kv_bits as given when it is None (full precision) or one of KV_BITS, else a ValueError naming what is accepted."""
    if bits is not None and (isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or bits not in KV_BITS):
        raise ValueError(f"kv_bits must be None (full precision) or one of {', '.join(map(str, KV_BITS))} (bits per stored key and "
                         f"value element), got {bits!r}")
    return None if bits is None else int(bits)


def check_storage(bits, group_size) -> tuple[int | None, int | None]:
    """(kv_bits, kv_group_size) checked: group_size resolved to DEFAULT_GROUP_SIZE when bits are set and it is None;
    a group size without bits is an error."""
    bits = check_kv_bits(bits)
    if bits is None:
        if group_size is not None:
            raise ValueError(f"kv_group_size={group_size!r} groups quantized storage: it takes kv_bits (8, 4 or 2), got kv_bits=None")
        return None, None
    try:
        group_size = as_count("kv_group_size", DEFAULT_GROUP_SIZE if group_size is None else group_size, MIN_GROUP_SIZE)
    except ValueError as err:
        raise ValueError(f"{err}: each group stores a scale and a zero point in the model's dtype beside its codes, and "
                         "smaller groups can take more bytes than full precision") from None
    return bits, group_size


def slots_in_memory_of(full_slots: int, bits: int, group_size: int, head_dim: int, itemsize: int, keys_axis: str) -> int:
    """The most slots per KV head that `bits`-bit storage holds in the KV bytes of `full_slots` slots at full precision
    (`itemsize` bytes an element, head_dim d), at least 1. A stored slot takes its key's and value's codes and its
    share of the scales and zero points (`itemsize` bytes each): values per slot in groups of `group_size` channels;
    keys per channel over groups of `group_size` slots (keys_axis "channel": a compressed context, `QuantizedSummary`,
    `QuantizedRaggedSummary`), one full-precision slot's bytes set aside for a head's last, partial key group, or per
    slot as values (keys_axis "token": a decode-mode stream, `QuantizedSlots`). Integer arithmetic throughout."""
    full_slots, head_dim = as_count("full_slots", full_slots, 1), as_count("head_dim", head_dim, 1)
    bits, group_size = check_storage(bits, group_size)
    if bits is None:
        raise ValueError("slots_in_memory_of needs bits, one of " + ", ".join(map(str, KV_BITS)))
    if keys_axis not in _AXES:
        raise ValueError(f"keys_axis must be one of {_AXES}, got {keys_axis!r}")
    full = 2 * head_dim * itemsize
    codes = -(-head_dim * bits // 8)
    slot_groups = 2 * itemsize * -(-head_dim // group_size)  # a scale and a zero point per group of one slot's channels
    if keys_axis == "token":
        return max(1, full_slots * full // (2 * (codes + slot_groups)))
    # group_size × a slot's bytes: its codes and value groups, and 1/group_size of its channels' key groups
    per_slot = group_size * (2 * codes + slot_groups) + 2 * itemsize * head_dim
    return max(1, group_size * (full_slots - 1) * full // per_slot)


def check_quantized_shapes(packed: torch.Size, scale: torch.Size, bits: int, group_size: int, axis: str, dim: int) -> None:
    """ValueError unless codes [B, H, n, ceil(dim·bits/8)] and scales of these shapes are what `quantize` writes."""
    check_kv_bits(bits)
    b, h, n, width = packed
    per = 8 // bits
    want = (b, h, -(-n // group_size), dim) if axis == "channel" else (b, h, n, -(-dim // group_size))
    if width != -(-dim // per) or tuple(scale) != want:
        raise ValueError(f"{bits}-bit codes {list(packed)} with scales {list(scale)} do not fit dim {dim}, group size {group_size}, axis "
                         f"{axis!r}: expected codes [{b}, {h}, {n}, {-(-dim // per)}] and scales {list(want)}")


@saved("quantized_tensor")
@dataclass(frozen=True)
class QuantizedTensor(Saveable):
    """A [B, H, n, d] tensor stored in `bits` bits per element.

    packed: uint8 [B, H, n, ceil(d·bits/8)], codes in [0, 2^bits - 1], the lowest bits first.
    scale / zero: [B, H, ceil(n/G), d] for axis "channel" (a group is G consecutive slots of one
    channel), [B, H, n, ceil(d/G)] for axis "token" (G consecutive channels of one slot); element
    x is stored as code q with x ≈ q·scale + zero. dim: d.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    axis: str
    dim: int

    saved_fields = {"packed": Tensor("b h n p", ("uint8",)), "scale": Tensor("b h s t"), "zero": Tensor("b h s t"), "bits": Count(1),
                    "group_size": Count(1), "axis": Choice(("channel", "token")), "dim": Count(1)}

    def check_saved(self) -> None:
        check_quantized_shapes(self.packed.shape, self.scale.shape, self.bits, self.group_size, self.axis, self.dim)
        if self.zero.shape != self.scale.shape:
            raise ValueError(f"zero points {list(self.zero.shape)} and scales {list(self.scale.shape)} differ in shape")

    @property
    def dtype(self) -> torch.dtype:
        return self.scale.dtype

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The stored tensor [B, H, n, d] in the scales' dtype (computed in float32, rounded once), written into `out`
        when given ([B, H, n, d] in that dtype on the codes' device, e.g. the first slots of a longer tensor that other
        slots follow) and returned."""
        shape, device = (*self.packed.shape[:-1], self.dim), self.packed.device
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=device)
        elif tuple(out.shape) != shape or out.dtype != self.dtype or out.device != device:
            raise ValueError(f"out must be {list(shape)} {self.dtype} on {device} to take this tensor, got {describe(out)}")
        work = out if out.dtype == torch.float32 else torch.empty(shape, dtype=torch.float32, device=device)
        along = 2 if self.axis == "channel" else 3  # the axis a group runs along
        if self.bits == 8 and along == 3:  # values: the in-place multiply-add reads the stored bytes as they are (`_dequantize_groups`)
            codes = self.packed
        else:
            codes = _unpack_into(self.packed, self.bits, work if along == 2 else torch.empty(shape, dtype=torch.float32, device=device))
        _dequantize_groups(codes, self.scale.float(), self.zero.float(), along, self.group_size, out=work)
        if work is not out:
            out.copy_(work)
        return out

    def nbytes(self) -> int:
        """Bytes stored: the packed codes, the scales and the zero points."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))

    def select_rows(self, index: torch.Tensor) -> "QuantizedTensor":
        """The batch rows `index` [k]."""
        return replace(self, **{k: getattr(self, k).index_select(0, index) for k in ("packed", "scale", "zero")})

    def to(self, device, dtype: torch.dtype) -> "QuantizedTensor":
        """Moved to `device`, scales and zero points cast to `dtype` (the codes are unchanged)."""
        return replace(self, packed=self.packed.to(device), scale=self.scale.to(device, dtype), zero=self.zero.to(device, dtype))


def quantize(x: torch.Tensor, bits: int, group_size: int, axis: str, valid: torch.Tensor | None = None) -> QuantizedTensor:
    """x [B, H, n, d] (floating) in `bits` bits, grouped along `axis` ("channel": keys, "token": values; see
    `QuantizedTensor`). valid [B, H, n] bool (axis "channel" only): slots whose values set no group's range
    (a group with no valid slot gets scale 0 and zero point 0). Scales and zero points take x's dtype."""
    bits = check_kv_bits(bits)
    if bits is None:
        raise ValueError("quantize needs bits, one of " + ", ".join(map(str, KV_BITS)))
    group_size = as_count("group_size", group_size, 1)
    if axis not in _AXES:
        raise ValueError(f"axis must be one of {_AXES}, got {axis!r}")
    if valid is not None and axis != "channel":
        raise ValueError("valid slots set the ranges of per-channel (key) groups; values are grouped per slot")
    work = x.float()
    along = 2 if axis == "channel" else 3  # the axis a group runs along
    low, high = work, work
    if valid is not None:
        hidden = ~valid[..., None]
        low, high = work.masked_fill(hidden, math.inf), work.masked_fill(hidden, -math.inf)
    if work.shape[along] == 0:  # no slot (a layer that keeps none of its middle): no group either
        low = high = work
    else:
        low = torch.cat([members.amin(along + 1) for members, _ in _group_members(low, along, group_size)], along)
        high = torch.cat([members.amax(along + 1) for members, _ in _group_members(high, along, group_size)], along)
    scale, zero, float_zero, steps = _scales(low, high, bits, x.dtype)
    codes = torch.empty(work.shape, dtype=torch.uint8, device=work.device)
    for (members, groups), (out, _) in zip(_group_members(work, along, group_size), _group_members(codes, along, group_size)):
        _codes_into(out, members, _per_member(float_zero, groups, along), _per_member(steps, groups, along), bits)
    return QuantizedTensor(_pack(codes, bits), scale, zero, bits, group_size, axis, x.shape[3])


def _group_members(t: torch.Tensor, along: int, group_size: int) -> list[tuple[torch.Tensor, slice]]:
    """The members of t's groups of `group_size` consecutive elements along axis `along`: (the whole groups' members, a
    view of t with that axis unflattened into (groups, group_size), those groups), then, if the axis does not divide,
    (the last group's members, a view with an axis of length 1 before them, that group). `_per_member` broadcasts a
    per-group tensor over either."""
    size = t.shape[along]
    whole = size - size % group_size
    parts = []
    if whole:
        parts.append((t.narrow(along, 0, whole).unflatten(along, (-1, group_size)), slice(0, whole // group_size)))
    if whole < size:
        parts.append((t.narrow(along, whole, size - whole).unsqueeze(along), slice(whole // group_size, whole // group_size + 1)))
    return parts


def _dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, along: int, group_size: int,
                       out: torch.Tensor) -> torch.Tensor:
    """Write into `out` (float32, `codes`' shape) zero point + code · scale, one fused multiply-add rounded once, from
    `codes`, the scale and zero point (float32, one entry per group of `group_size` consecutive elements along axis
    `along`) of each group broadcast over its members, neither copied per element. Returns `out`.

    Where the groups run along other axes (keys), `codes` are float32 and may be `out` itself: the CPU's fused
    `addcmul(out=)` is fast there, but slow with a uint8 operand. Where they run along the last axis (values), the
    scales broadcast along the innermost axis, where `addcmul(out=)` is several times slower, so the zero points are
    written into `out` first and the product added to them in place (`addcmul_`), which reads 8-bit codes as stored
    (uint8) at full speed; `out` must then be apart from `codes`."""
    innermost = along == codes.ndim - 1
    for (members, groups), (dest, _) in zip(_group_members(codes, along, group_size), _group_members(out, along, group_size)):
        scale_of, zero_of = _per_member(scale, groups, along), _per_member(zero, groups, along)
        if innermost:
            dest.copy_(zero_of.expand_as(dest)).addcmul_(members, scale_of)
        else:
            torch.addcmul(zero_of, members, scale_of, out=dest)
    return out


def _per_member(per_group: torch.Tensor, groups: slice, along: int) -> torch.Tensor:
    """`per_group` (one entry per group along axis `along`) restricted to `groups` and broadcastable over their members
    as `_group_members` lays them out."""
    return per_group.narrow(along, groups.start, groups.stop - groups.start).unsqueeze(along + 1)


def _scales(low: torch.Tensor, high: torch.Tensor, bits: int, dtype: torch.dtype):
    """(scale, zero point) in `dtype` of groups whose ranges are low / high (+inf / -inf: a group with no member, given
    scale 0 and zero point 0), and the same in float32 as the codes are rounded against them: (the zero points, the
    steps, 1 where the scale is 0)."""
    empty = torch.isinf(low)
    low, high = low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)
    levels = (1 << bits) - 1
    zero, scale = low.to(dtype), ((high - low) / levels).to(dtype)
    # a scale rounded up to `dtype` puts the top level above the group's maximum: near the end of `dtype`'s range (float16's
    # 65504) past it, where dequantization gives inf; one step towards 0 keeps that level within the group's range
    over = zero.float() + levels * scale.float() > torch.finfo(dtype).max
    scale = torch.where(over, torch.nextafter(scale, torch.zeros_like(scale)), scale)
    float_scale = scale.float()
    return scale, zero, zero.float(), torch.where(float_scale > 0, float_scale, torch.ones_like(float_scale))


def _codes_into(out: torch.Tensor, members: torch.Tensor, zero: torch.Tensor, steps: torch.Tensor, bits: int) -> None:
    """Write into uint8 `out` the `bits`-bit codes of `members` (float32) against their groups' zero points and steps
    (broadcast over them, `_scales`), rounded to the nearest level."""
    out.copy_(((members - zero) / steps).round_().clamp_(0, (1 << bits) - 1))


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., d] < 2^bits -> [..., ceil(d·bits/8)], 8/bits codes a byte, the first in the lowest bits."""
    per = 8 // bits
    if per == 1:
        return codes.contiguous()
    d = codes.shape[-1]
    codes = F.pad(codes, (0, -(-d // per) * per - d)).unflatten(-1, (-1, per))
    packed = codes[..., 0].clone()
    for i in range(1, per):  # one elementwise op per code of a byte
        packed |= codes[..., i] << (bits * i)
    return packed


def _unpack(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """The inverse of `_pack`: uint8 codes [..., d]."""
    return _unpack_into(packed, bits, packed.new_empty(*packed.shape[:-1], d))


def _unpack_into(packed: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """`_unpack(packed, bits, d)` written into `out` [..., d] (any dtype that holds the codes; its last axis contiguous)
    and returned: each code of a byte is shifted out and written to its channels in one op (read at every step of
    attention over stored codes), no uint8 copy of them all first."""
    per, d = 8 // bits, out.shape[-1]
    if per == 1:
        return out.copy_(packed)
    mask = (1 << bits) - 1
    whole = d // per  # bytes whose every code is a channel (the last byte may hold fewer)
    channels = out.narrow(-1, 0, whole * per).unflatten(-1, (whole, per))
    for i in range(per):
        code = packed.narrow(-1, 0, whole) >> (bits * i)
        channels[..., i].copy_(code & mask if i < per - 1 else code)
    if whole * per < d:
        last = packed.narrow(-1, whole, 1)
        for i in range(d - whole * per):
            out.narrow(-1, whole * per + i, 1).copy_((last >> (bits * i)) & mask)
    return out


@saved("quantized_summary")
@dataclass(frozen=True)
class QuantizedSummary(Saveable):
    """A `KVSummary` whose keys and values (and normalizer keys) are stored quantized; immutable.

    keys: axis "channel", values: axis "token" (`quantize`). log_weights [B, H, n] float32, None
    for an eviction-only summary (every weight 0, no normalizer). positions [B, H, n] int32.
    normalizer: (keys quantized per channel, log_weights, positions int32) or None.
    `summary()` is the dequantized `KVSummary`, with the original's eviction_only.
    """

    keys: QuantizedTensor
    values: QuantizedTensor
    log_weights: torch.Tensor | None
    positions: torch.Tensor
    normalizer: tuple[QuantizedTensor, torch.Tensor, torch.Tensor] | None = None

    saved_fields = {
        "keys": Instance("quantized_tensor"), "values": Instance("quantized_tensor"), "log_weights": Maybe(Tensor("B H n")),
        "positions": Tensor("B H n", ("int32",)),
        "normalizer": Maybe(Record((Instance("quantized_tensor"), Tensor("B H m"), Tensor("B H m", ("int32",))))),
    }

    @classmethod
    def from_saved(cls, values):
        return cls(**values)

    def check_saved(self) -> None:
        shape = tuple(self.positions.shape)
        parts = [("keys", self.keys, shape, "channel"), ("values", self.values, shape, "token")]
        if self.normalizer is not None:
            parts.append(("normalizer keys", self.normalizer[0], tuple(self.normalizer[2].shape), "channel"))
        for name, q, want, axis in parts:
            if tuple(q.packed.shape[:3]) != want or q.axis != axis:
                raise ValueError(f"{name}: codes {list(q.packed.shape)} on axis {q.axis!r}, expected {list(want)} slots on axis {axis!r}")

    @classmethod
    def of(cls, summary: KVSummary, bits: int, group_size: int) -> "QuantizedSummary":
        """`summary` quantized: keys per channel over the slots of finite log-weight, values per slot."""
        keys = quantize(summary.keys, bits, group_size, "channel", torch.isfinite(summary.log_weights))
        values = quantize(summary.values, bits, group_size, "token")
        norm = summary.normalizer
        if norm is not None:
            norm = (quantize(norm.keys, bits, group_size, "channel", torch.isfinite(norm.log_weights)), norm.log_weights.to(torch.float32, copy=True),
                    _int32(norm.positions))
        log_weights = None if summary.eviction_only else summary.log_weights.to(torch.float32, copy=True)  # not a view of the summary's
        return cls(keys, values, log_weights, _int32(summary.positions), norm)

    @property
    def num_slots(self) -> int:
        return self.positions.shape[2]

    @property
    def eviction_only(self) -> bool:
        return self.log_weights is None

    def summary(self) -> KVSummary:
        """The dequantized summary (keys and values in the stored scales' dtype, positions int64)."""
        log_weights, positions = self.summary_weights()
        norm = None
        if self.normalizer is not None:
            keys, norm_weights, norm_positions = self.normalizer
            norm = Normalizer(keys.dequantize(), norm_weights, norm_positions.long())
        return KVSummary(self.keys.dequantize(), self.values.dequantize(), log_weights, positions, norm, self.eviction_only)

    def summary_then(self, rest: list[KVSummary]) -> KVSummary:
        """`concat([self.summary(), *rest])`: the dequantized summary followed by the slots of `rest` (summaries of its
        batch rows, KV heads, head dims, dtype and device), the dequantized keys and values written straight into the
        joined tensors rather than copied there (attention over a quantized context and its exact tail reads this at
        every step)."""
        if not rest or self.normalizer is not None or any(p.normalizer is not None for p in rest):
            return concat([self.summary(), *rest])
        check_joinable(rest)
        b, h, n = self.positions.shape
        first = rest[0]
        layout = (b, h, self.keys.dim, self.values.dim, self.keys.dtype, self.values.dtype, self.positions.device)
        if layout != (*first.keys.shape[:2], first.keys.shape[3], first.values.shape[3], first.keys.dtype, first.values.dtype, first.keys.device):
            raise ValueError(f"the slots after a quantized summary of {b} batch rows, {h} KV heads, key and value dims {self.keys.dim} "
                             f"and {self.values.dim} in {self.keys.dtype} on {self.positions.device} must match it: got keys "
                             f"{describe(first.keys)} and values {describe(first.values)}")
        total = n + sum(p.num_slots for p in rest)
        keys = self.keys.packed.new_empty(b, h, total, self.keys.dim, dtype=self.keys.dtype)
        values = self.values.packed.new_empty(b, h, total, self.values.dim, dtype=self.values.dtype)
        self.keys.dequantize(out=keys[:, :, :n])
        self.values.dequantize(out=values[:, :, :n])
        start = n
        for p in rest:
            keys[:, :, start : start + p.num_slots] = p.keys
            values[:, :, start : start + p.num_slots] = p.values
            start += p.num_slots
        own = self.summary_weights()
        return KVSummary(keys, values, torch.cat([own[0], *(p.log_weights for p in rest)], 2),
                         torch.cat([own[1], *(p.positions for p in rest)], 2),
                         eviction_only=self.eviction_only and all(p.eviction_only for p in rest))

    def summary_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(log_weights float32 [B, H, n], 0 where eviction-only; positions int64 [B, H, n]) of `summary()`."""
        positions = self.positions.long()
        if self.log_weights is None:
            return torch.zeros(1, dtype=torch.float32, device=positions.device).expand(positions.shape), positions
        return self.log_weights, positions

    def nbytes(self) -> int:
        """KV bytes stored: packed keys and values (and normalizer keys) with their scales and zero points."""
        return self.keys.nbytes() + self.values.nbytes() + (self.normalizer[0].nbytes() if self.normalizer is not None else 0)

    def index_nbytes(self) -> int:
        """Bytes of the log-weights (none when eviction-only) and positions held (and the normalizer's)."""
        parts = [t for t in (self.log_weights, self.positions) if t is not None]
        if self.normalizer is not None:
            parts += list(self.normalizer[1:])
        return sum(t.numel() * t.element_size() for t in parts)

    def select_rows(self, index: torch.Tensor) -> "QuantizedSummary":
        """The batch rows `index` [k] (beam search)."""
        index = index.to(self.positions.device)
        norm = self.normalizer
        if norm is not None:
            norm = (norm[0].select_rows(index), norm[1].index_select(0, index), norm[2].index_select(0, index))
        log_weights = self.log_weights.index_select(0, index) if self.log_weights is not None else None
        return QuantizedSummary(self.keys.select_rows(index), self.values.select_rows(index), log_weights,
                                self.positions.index_select(0, index), norm)

    def to(self, device, dtype: torch.dtype) -> "QuantizedSummary":
        """Every tensor moved to `device`, scales and zero points cast to `dtype`."""
        norm = self.normalizer
        if norm is not None:
            norm = (norm[0].to(device, dtype), norm[1].to(device), norm[2].to(device))
        log_weights = self.log_weights.to(device) if self.log_weights is not None else None
        return QuantizedSummary(self.keys.to(device, dtype), self.values.to(device, dtype), log_weights, self.positions.to(device), norm)


@saved("quantized_ragged_summary")
@dataclass(frozen=True)
class QuantizedRaggedSummary(PackedByHead, Saveable):
    """A summary whose heads keep different numbers of slots (AdaKV's empty slots) stored packed as `RaggedSummary`
    stores it (the real slots only, head after head) and quantized as `QuantizedSummary` is (keys per channel over
    groups of `group_size` consecutive slots of one head's run, values per slot); immutable.

    key_codes uint8 [T, ceil(d·bits/8)] with key_scale / key_zero [Tg, d]: the groups of every head, ceil(count/G)
    each, packed head after head as the slots are (slot i of a head's run is in that head's group i // G). values: a
    `QuantizedTensor` [1, 1, T, d_v] (axis "token"). log_weights [T] float32 or None (every real slot of weight 0),
    positions [T] int32, counts [B, H] int32. So a head stores only what it keeps, quantized, and the groups of its
    run: no code or scale for an empty slot.
    """

    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    values: QuantizedTensor
    log_weights: torch.Tensor | None
    positions: torch.Tensor
    counts: torch.Tensor
    bits: int
    group_size: int

    saved_fields = {"key_codes": Tensor("T P", ("uint8",)), "key_scale": Tensor("G D"), "key_zero": Tensor("G D"),
                    "values": Instance("quantized_tensor"), "log_weights": Maybe(Tensor("T")), "positions": Tensor("T", ("int32",)),
                    "counts": Tensor("B H", ("int32",)), "bits": Count(1), "group_size": Count(1)}

    @classmethod
    def from_saved(cls, values):
        return cls(**values)

    def check_saved(self) -> None:
        check_kv_bits(self.bits)
        self.check_counts()
        total, groups = self.positions.shape[0], self.key_scale.shape[0]
        if int(self._group_counts.sum()) != groups or self.key_zero.shape != self.key_scale.shape:
            raise ValueError(f"keys: {groups} groups of scales {list(self.key_scale.shape)} and zero points {list(self.key_zero.shape)}, "
                             f"expected {int(self._group_counts.sum())} (ceil(count / {self.group_size}) per head) of one shape")
        if self.key_codes.shape != (total, -(-self.key_scale.shape[1] * self.bits // 8)):
            raise ValueError(f"key codes {list(self.key_codes.shape)} do not hold {total} slots of {self.key_scale.shape[1]} {self.bits}-bit codes")
        if tuple(self.values.packed.shape[:3]) != (1, 1, total) or self.values.axis != "token":
            raise ValueError(f"values: codes {list(self.values.packed.shape)} on axis {self.values.axis!r}, expected [1, 1, {total}, ...] on axis 'token'")

    @classmethod
    def of(cls, summary: KVSummary, bits: int, group_size: int) -> "QuantizedRaggedSummary":
        """`summary` (no normalizer) packed without its empty slots (`RaggedSummary.of`), then quantized."""
        bits, group_size = check_kv_bits(bits), as_count("group_size", group_size, 1)
        if bits is None:
            raise ValueError("QuantizedRaggedSummary needs bits, one of " + ", ".join(map(str, KV_BITS)))
        packed = RaggedSummary.of(summary)
        work = packed.keys.float()
        group = cls._slot_groups(packed.counts, group_size)
        groups = int(cls._group_counts_of(packed.counts, group_size).sum())
        at = group[:, None].expand_as(work)
        low = work.new_full((groups, work.shape[1]), math.inf).scatter_reduce_(0, at, work, "amin")
        high = work.new_full((groups, work.shape[1]), -math.inf).scatter_reduce_(0, at, work, "amax")
        scale, zero, float_zero, steps = _scales(low, high, bits, packed.keys.dtype)
        codes = torch.empty(work.shape, dtype=torch.uint8, device=work.device)
        _codes_into(codes, work, float_zero.index_select(0, group), steps.index_select(0, group), bits)
        codes = _pack(codes, bits)
        values = quantize(packed.values[None, None], bits, group_size, "token")
        return cls(codes, scale, zero, values, packed.log_weights, packed.positions, packed.counts, bits, group_size)

    @staticmethod
    def _group_counts_of(counts: torch.Tensor, group_size: int) -> torch.Tensor:
        """[B, H] int64: the key groups of each head's run of `counts` slots."""
        return (counts.long() + group_size - 1) // group_size

    @cached_property
    def _group_counts(self) -> torch.Tensor:
        """[B, H] int64: the key groups of each head's run (`_group_counts_of`)."""
        return self._group_counts_of(self.counts, self.group_size)

    @classmethod
    def _slot_groups(cls, counts: torch.Tensor, group_size: int) -> torch.Tensor:
        """[T] int64: the packed key group of each packed slot (its head's first group, then one every group_size slots)."""
        head, within = packed_heads(counts)
        per_head = cls._group_counts_of(counts, group_size).flatten()
        return (per_head.cumsum(0) - per_head)[head] + within // group_size

    @cached_property
    def _key_runs(self) -> list[tuple[slice, slice]]:
        """(its packed slots, its key groups) of each head that keeps a slot, from the counts read once (every
        `ragged()` dequantizes the keys run by run)."""
        runs, slot, group = [], 0, 0
        for count, groups in zip(self.run_counts, self._group_counts.flatten().tolist()):
            if count:
                runs.append((slice(slot, slot + count), slice(group, group + groups)))
            slot, group = slot + count, group + groups
        return runs

    def ragged(self) -> RaggedSummary:
        """The dequantized slots, still packed (attention reads them where they are, as a `RaggedSummary`'s), keys and
        values in the stored scales' dtype; its layout from this summary's, read from the device once. The keys are
        dequantized head run by head run, each run's groups broadcast over their slots (`_dequantize_groups`)."""
        keys = _unpack_into(self.key_codes, self.bits, self.key_scale.new_empty(self.key_codes.shape[0], self.key_scale.shape[1],
                                                                                dtype=torch.float32))
        scale, zero = self.key_scale.float(), self.key_zero.float()
        for slots, groups in self._key_runs:
            _dequantize_groups(keys[slots], scale[groups], zero[groups], 0, self.group_size, out=keys[slots])
        packed = RaggedSummary(keys.to(self.key_scale.dtype), self.values.dequantize()[0, 0], self.log_weights, self.positions, self.counts)
        return packed.with_layout_of(self)

    def summary(self) -> KVSummary:
        """The dequantized padded summary (`RaggedSummary.summary` of `ragged()`)."""
        return self.ragged().summary()

    def nbytes(self) -> int:
        """KV bytes stored: key codes, scales and zero points, the values' (`QuantizedTensor.nbytes`), and the per-head counts."""
        return self.values.nbytes() + sum(t.numel() * t.element_size() for t in (self.key_codes, self.key_scale, self.key_zero, self.counts))

    def index_nbytes(self) -> int:
        """Bytes of the packed positions and log-weights (none when every weight is 0)."""
        return sum(t.numel() * t.element_size() for t in (self.positions, self.log_weights) if t is not None)

    def select_rows(self, index: torch.Tensor) -> "QuantizedRaggedSummary":
        """The batch rows `index` [k] (beam search), each row's packed slots and key groups copied."""
        index = index.to(self.counts.device).long()
        slots, groups = row_elements(self.counts, index), row_elements(self._group_counts, index)

        def pick(t, at):
            return t.index_select(0, at) if t is not None else None

        values = replace(self.values, **{k: getattr(self.values, k).index_select(2, slots) for k in ("packed", "scale", "zero")})
        return QuantizedRaggedSummary(pick(self.key_codes, slots), pick(self.key_scale, groups), pick(self.key_zero, groups), values,
                                      pick(self.log_weights, slots), pick(self.positions, slots), self.counts.index_select(0, index),
                                      self.bits, self.group_size)

    def to(self, device, dtype: torch.dtype) -> "QuantizedRaggedSummary":
        """Every tensor moved to `device`, scales and zero points cast to `dtype` (codes, log-weights, positions and counts unchanged)."""
        log_weights = self.log_weights.to(device) if self.log_weights is not None else None
        return QuantizedRaggedSummary(self.key_codes.to(device), self.key_scale.to(device, dtype), self.key_zero.to(device, dtype),
                                      self.values.to(device, dtype), log_weights, self.positions.to(device), self.counts.to(device),
                                      self.bits, self.group_size)


def _int32(positions: torch.Tensor) -> torch.Tensor:
    """Positions (token indices, -1 for empty slots) as int32; a position past int32's range is an error."""
    if positions.numel() and int(positions.max()) > torch.iinfo(torch.int32).max:
        raise ValueError(f"positions up to {int(positions.max())} do not fit the int32 a quantized summary stores them in")
    return positions.to(torch.int32).contiguous()


def quantize_rows(x: torch.Tensor, bits: int, group_size: int, known: list[tuple[torch.Tensor, QuantizedTensor]] = ()) -> QuantizedTensor:
    """x [..., d] quantized row by row (a row: the last axis, grouped over `group_size` consecutive channels as axis
    "token" of `quantize` groups a slot), as one [1, 1, rows, d] `QuantizedTensor`.

    known: pairs (rows [..., d] as they were dequantized, the `QuantizedTensor` [..., d] they came from, of the same
    bits, group size and dtype). A row of x equal bit for bit to a known row takes that row's codes, scale and zero
    point instead of being quantized again: re-quantizing a dequantized row is not exact (the scale it computes can
    differ in its last bit), so a row a stream keeps, moves or copies is rounded once however often it is stored.
    """
    d = x.shape[-1]
    rows = x.reshape(1, 1, -1, d)
    fresh = quantize(rows, bits, group_size, "token")
    known = [(content.reshape(-1, d), q) for content, q in known if content.shape[-1] == d and content.numel()]
    if not known or rows.shape[2] == 0:
        return fresh
    match = _find_rows(rows[0, 0], torch.cat([content for content, _ in known]))
    hit = (match >= 0)[:, None]
    at = match.clamp_min(0)

    def pick(name: str) -> torch.Tensor:
        pool = torch.cat([getattr(q, name).reshape(-1, getattr(q, name).shape[-1]) for _, q in known])
        mine = getattr(fresh, name)
        return torch.where(hit, pool[at], mine[0, 0]).view(mine.shape)

    return replace(fresh, packed=pick("packed"), scale=pick("scale"), zero=pick("zero"))


def _find_rows(rows: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """For each row of rows [N, d], the index of a row of pool [P ≥ 1, d] with the same bits, or -1 ([N] int64).

    Each row's bits, read as int16 words, are reduced to one int64 key by a fixed random linear map (words below 2^15,
    weights below 2^31, at most 2^16 words: the sum is exact); a row whose key is found among the pool's is then
    compared word for word. Equal rows have equal keys, so no match is missed; two different rows with one key (one in
    about 2^31 pairs) send the lookup to `torch.unique` over whole rows, which is exact and slower."""
    words = torch.cat([pool, rows]).contiguous().view(torch.int16)
    size = pool.shape[0]
    if words.shape[1] > 2**16:
        return _find_rows_exactly(words, size)
    keys = _row_keys(words)
    pool_keys, order = keys[:size].sort()
    at = torch.searchsorted(pool_keys, keys[size:]).clamp_(max=size - 1)
    found = pool_keys[at] == keys[size:]
    match = torch.where(found, order[at], -1)
    if bool((found & ~(words[order[at]] == words[size:]).all(-1)).any()):
        return _find_rows_exactly(words, size)
    return match


def _row_keys(words: torch.Tensor) -> torch.Tensor:
    """[n] int64: each row of words [n, w] (int16, w ≤ 2^16) under a fixed random linear map, exact in int64."""
    return (words.long() * _key_weights(words.shape[1], words.device)).sum(-1)


@lru_cache(maxsize=16)
def _key_weights(width: int, device: torch.device) -> torch.Tensor:
    """[width] int64 in [1, 2^31): `_row_keys`' map, drawn once per row width and device (seed 0)."""
    return torch.randint(1, 2**31, (width,), generator=torch.Generator().manual_seed(0)).to(device)


def _find_rows_exactly(words: torch.Tensor, pool_size: int) -> torch.Tensor:
    """`_find_rows` over the pool's then the rows' words [P + N, w], by `torch.unique` over whole rows."""
    unique, inverse = torch.unique(words, dim=0, return_inverse=True)
    first = torch.full((unique.shape[0],), -1, dtype=torch.long, device=words.device)
    first.scatter_(0, inverse[:pool_size], torch.arange(pool_size, device=words.device))
    return first[inverse[pool_size:]]


@saved("quantized_slots")
class QuantizedSlots(Saveable):
    """The slot buffer of a block-wise stream (`methods.base.BlockwiseState`) with keys and values stored in `bits` bits.

    The interface of `summary._GrowingSlots` over the columns (keys, values, positions, extra per-slot columns):
    `append(columns, reserve=, most=)` quantizes the keys and the values of the new slots, each slot over groups of
    `group_size` consecutive channels (axis "token" of `quantize`, for keys as well: module docstring), and stores
    the codes with their scales and zero points; the other columns are stored as they are. `view()` returns the
    columns with keys and values dequantized (in the scales' dtype, the stream's). `take(index, ...)` keeps the slots
    `index` [B, H, k] of every head in a new buffer by selecting their stored codes: a slot is quantized once, however
    many re-compressions it survives.
    """

    def __init__(self, bits: int, group_size: int):
        self.bits, self.group_size = check_kv_bits(bits), as_count("group_size", group_size, 1)
        if self.bits is None:
            raise ValueError("QuantizedSlots needs bits, one of " + ", ".join(map(str, KV_BITS)))
        self.raw = _GrowingSlots()  # key packed, scale, zero; value packed, scale, zero; then the other columns
        self.dims: tuple[int, int] | None = None

    saved_fields = {"bits": Count(1), "group_size": Count(1), "raw": Instance("growing_slots"), "dims": Maybe(Record((Count(1), Count(1))))}

    def check_saved(self) -> None:
        check_kv_bits(self.bits)
        if not self.raw.tensors:
            return
        if self.dims is None or self.raw.width < 6:
            raise ValueError(f"quantized slots hold {self.raw.width} columns with dims {self.dims}: expected the codes, scales and zero "
                             "points of keys and values (6 columns) and their dims")
        for i, dim in enumerate(self.dims):
            packed, scale, zero = self.raw.tensors[3 * i : 3 * i + 3]
            check_quantized_shapes(packed.shape, scale.shape, self.bits, self.group_size, "token", dim)
            if zero.shape != scale.shape or packed.dtype != torch.uint8:
                raise ValueError(f"column {3 * i}: zero points {list(zero.shape)} or codes ({packed.dtype}) do not match the scales")

    @property
    def length(self) -> int:
        return self.raw.length

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.raw.tensors

    @property
    def width(self) -> int:
        """Columns stored, as `view()` returns them (keys and values count one each)."""
        return self.raw.width - 4

    def encode(self, columns: tuple[torch.Tensor, ...], known: list[tuple[torch.Tensor, QuantizedTensor]] = ()) -> tuple[torch.Tensor, ...]:
        """Slots [B, H, n, ...] per column (keys, values, positions, extra columns) as this buffer stores them (`stored()`),
        not stored yet: keys and values quantized; known: rows that keep their codes (`quantize_rows`)."""
        keys, values, *rest = columns
        if self.dims is None:
            self.dims = (keys.shape[-1], values.shape[-1])
        parts = []
        for x in (keys, values):
            q = quantize_rows(x, self.bits, self.group_size, known)
            parts += [t.view(*x.shape[:3], t.shape[-1]) for t in (q.packed, q.scale, q.zero)]
        return (*parts, *rest)

    def append(self, columns: tuple[torch.Tensor, ...], reserve: int = 0, most: int | None = None,
               known: list[tuple[torch.Tensor, QuantizedTensor]] = ()) -> None:
        """Append slots [B, H, n, ...] per column; known: rows that keep their codes (`quantize_rows`)."""
        self.raw.append(self.encode(columns, known), reserve=reserve, most=most)

    def view(self) -> tuple[torch.Tensor, ...]:
        return self.decoded(self.raw.view())

    def decoded(self, columns: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Columns [..., n, ...] as this buffer stores them (`stored()`) with keys and values dequantized (in the scales'
        dtype): keys, values, then the other columns as they are."""
        keys, values = self._tensors(columns)
        return (keys.dequantize(), values.dequantize(), *columns[6:])

    def _tensors(self, columns: tuple[torch.Tensor, ...]) -> tuple[QuantizedTensor, QuantizedTensor]:
        """The keys' and the values' `QuantizedTensor` [B, H, n, d] of columns [B, H, n, ...] as stored."""
        return tuple(QuantizedTensor(*columns[3 * i : 3 * i + 3], self.bits, self.group_size, "token", self.dims[i]) for i in range(2))

    def stored(self) -> tuple[torch.Tensor, ...]:
        """The columns as stored [B, H, n, ...]: key codes, scales and zero points, the values' three, then the other
        columns (positions first)."""
        return self.raw.view()

    def emptied(self) -> "QuantizedSlots":
        """An empty buffer of the same bits, group size and dims."""
        out = QuantizedSlots(self.bits, self.group_size)
        out.dims = self.dims
        return out

    def take(self, index: torch.Tensor, reserve: int = 0, most: int | None = None) -> "QuantizedSlots":
        """A new buffer holding the slots `index` [B, H, k] (ascending per head) of this one, their codes as stored."""
        out = self.emptied()
        out.raw.append(tuple(take_slots(t, index) for t in self.raw.view()), reserve=reserve, most=most)
        return out

    def known(self) -> list[tuple[torch.Tensor, QuantizedTensor]]:
        """(dequantized keys, their codes) and (dequantized values, their codes) of the slots held, as `quantize_rows`
        takes them: a stream handing these slots on keeps their codes. None held (an empty buffer): []."""
        if self.dims is None or self.length == 0:
            return []
        return [(q.dequantize(), q) for q in self._tensors(self.raw.view())]

    def kv_bytes(self) -> int:
        """Bytes allocated (room included) for the codes, scales and zero points of keys and values, and for any
        other per-slot vector column [B,H,capacity,d] (stored pre-RoPE keys); per-slot scalars are bookkeeping."""
        return sum(t.numel() * t.element_size() for i, t in enumerate(self.raw.tensors) if i < 6 or t.ndim == 4)


@saved("quantized_ragged_slots")
@dataclass(frozen=True)
class QuantizedRaggedSlots(PackedByHead, Saveable):
    """Slots packed head after head as `RaggedSummary` packs them, each quantized on its own as `QuantizedSlots` stores a
    stream's slots (keys and values per slot, over groups of `group_size` consecutive channels): what a head-adaptive
    stream keeps between re-compressions (`methods.adakv.AdaptiveBlockwiseState`). A re-compression selects stored
    codes (`stored_columns`, `of_stored`), so a slot is quantized once, when it enters the stream; immutable.

    keys [1, 1, T, d] and values [1, 1, T, d_v]: `QuantizedTensor`s on axis "token" (T: the slots of every batch row and
    head); positions [T] int32; counts [B, H] int32 (slots per head; they sum to T). Every slot has weight 0.
    """

    keys: QuantizedTensor
    values: QuantizedTensor
    positions: torch.Tensor
    counts: torch.Tensor
    log_weights = None  # every slot of weight 0 (`PackedByHead`)

    saved_fields = {"keys": Instance("quantized_tensor"), "values": Instance("quantized_tensor"), "positions": Tensor("T", ("int32",)),
                    "counts": Tensor("B H", ("int32",))}

    @classmethod
    def from_saved(cls, values):
        return cls(**values)

    def check_saved(self) -> None:
        self.check_counts()
        total = self.positions.shape[0]
        for name, q in (("keys", self.keys), ("values", self.values)):
            if tuple(q.packed.shape[:3]) != (1, 1, total) or q.axis != "token" or (q.bits, q.group_size) != (self.keys.bits, self.keys.group_size):
                raise ValueError(f"{name}: codes {list(q.packed.shape)} on axis {q.axis!r} in {q.bits} bits, expected [1, 1, {total}, ...] "
                                 f"on axis 'token' in the keys' {self.keys.bits} bits and groups of {self.keys.group_size}")

    @classmethod
    def of_stored(cls, columns: list[torch.Tensor], counts: torch.Tensor, slots: QuantizedSlots) -> "QuantizedRaggedSlots":
        """From packed columns [T, ...] in the order `slots` (a `QuantizedSlots` of the same bits, group size and dims)
        stores them: key codes, scales and zero points, the values' three, positions."""
        keys, values = slots._tensors([c[None, None] for c in columns[:6]])
        return cls(keys, values, _int32(columns[6]), counts.to(torch.int32))

    def stored_columns(self) -> tuple[torch.Tensor, ...]:
        """The packed columns [T, ...] in `QuantizedSlots`'s order (`of_stored`); positions int32."""
        return (*(t[0, 0] for q in (self.keys, self.values) for t in (q.packed, q.scale, q.zero)), self.positions)

    def ragged(self) -> RaggedSummary:
        """The dequantized slots, still packed (attention reads them where they are), keys and values in the scales'
        dtype; its layout from this packing's, read from the device once."""
        packed = RaggedSummary(self.keys.dequantize()[0, 0], self.values.dequantize()[0, 0], None, self.positions, self.counts)
        return packed.with_layout_of(self)

    def nbytes(self) -> int:
        """KV bytes stored: codes, scales and zero points of keys and values, and the per-head counts."""
        return self.keys.nbytes() + self.values.nbytes() + self.counts.numel() * self.counts.element_size()
