"""`Stream`: any method run over a token stream, with the first `sink` and last `window` tokens exact."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import torch

from ..checks import as_count, check_kv, check_layer, check_positions, check_scale, describe
from ..quantization import QuantizedSlots
from ..saved_state import Count, Device, DType, Generator, Instance, Linked, Maybe, Real, Record, Saveable, saved
from ..ragged import concat_parts
from ..summary import KVSummary, _GrowingSlots
from .base import Method, StreamState
from .budget import check_sink_window
from .tokens import (
    Tokens,
    append_columns,
    cat_tokens,
    query_positions_for,
    token_columns,
    tokens_from_columns,
)


def batch_coupling(method: Method, rows: int, solo_draws: bool = False) -> str | None:
    """Why a stream of `method` over a batch of `rows` rows would let one row change what another keeps, or None when it
    would not (one row; a method whose stream keeps each row apart, `Method.stream_rows_apart`). solo_draws: also name a
    randomized method, whose draws for a batch are not a row's own (what a cache needs, whose rows answer as alone)."""
    if rows <= 1 or (method.stream_rows_apart and not (solo_draws and method.randomized)):
        return None
    if method.randomized:
        return f"draws random numbers, and a stream of a batch of {rows} rows would draw them for every row at once"
    return (f"streams a batch's rows together, each head padded to the longest head of the batch, and its scores read "
            f"every key of a head, so a row of a batch of {rows} would keep other tokens")


@saved("stream")
class Stream(Saveable):
    """A method run as a stream, with the first `sink` tokens and the last `window` tokens exact.

    update() takes the next block of tokens (any size >= 1; a refused block changes nothing); tokens leaving the window are absorbed by
    the method's state, which stores at most `budget` slots per head at every step, the block being
    absorbed included (`methods.budget.stream_split`; PyramidKV's lower layers, which keep more,
    aside: `BlockwiseState`). A natively streaming method (Express, SubGen) holds at most `budget`
    by construction; ClusterGen's and BalanceKV's native streams keep their waiting work in the
    room the slack leaves beside their target. A block-wise one (every score method, Compactor, the
    hybrid's exact set) fills its buffer up to `budget` slots and compresses what is held back to
    its target, floor(budget / (1 + slack)), when the next tokens do not fit (a block larger than
    the room goes in in pieces), so its cost stays linear in the stream length. slack=None is
    DEFAULT_SLACK; slack=0 leaves one slot of room (a re-compression at every token once the
    buffer is full); an explicit slack for a method that never re-compresses is an error.
    compact() gives back the room the state reserves for later tokens (e.g. at the end of a prompt).
    summary() is sink + method summary + window.

    Every method streams exactly while it can: a state that is not exact by itself while it holds
    at most `budget` tokens (`StreamState.exact_within_budget`) gets the tokens leaving the window
    only once more than `budget` of them have left it (all at once), and they are held as they are
    until then. So at a budget of at least the tokens seen the summary is the exact input, for
    every method but one that drops tokens within its budget (`Method.drops_within_budget`, KVzap's threshold: its state
    takes every token from the first), and the buffer never allocates more slots than tokens have left the window.
    unrotate (from a cache that can invert its model's rotation, see `Tokens.unrotate`): pre-RoPE
    keys are computed from the keys when a method needs them, instead of passed and stored.
    kv_bits (with kv_group_size): the tokens held until they pass the budget and the method's state
    are stored in that many bits, each slot quantized once as it enters (`StreamState.quantized`: a
    block-wise buffer of codes, or a native state wrapped by `QuantizedState`); sink and window stay exact.
    """

    def __init__(self, method: Method, budget: int, sink: int, window: int, generator: torch.Generator, scale: float | None = None,
                 slack: float | None = None, unrotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 kv_bits: int | None = None, kv_group_size: int | None = None):
        sink, window = check_sink_window(sink, window)
        budget = as_count("budget", budget, 1)
        method.check_stream_window(window)
        self.method, self.budget, self.sink, self.window = method, budget, sink, window
        self.generator, self.scale = generator, check_scale(scale)
        self.state = method.new_stream(budget, generator, slack)
        if kv_bits is not None:
            self.state = self.state.quantized(kv_bits, kv_group_size)
        self.unrotate = unrotate
        self.head: Tokens | None = None
        self.recent: Tokens | None = None
        # tokens that left the window, until more than budget did (then None); None from the start for a state exact by itself
        self.exact: _GrowingSlots | QuantizedSlots | None = None
        if not self.state.exact_within_budget and not method.drops_within_budget:
            self.exact = _GrowingSlots() if kv_bits is None else QuantizedSlots(kv_bits, kv_group_size)
        self.exact_last: Tokens | None = None
        self.seen = 0
        self.layout: tuple | None = None  # (B, H_kv, d, d_v, dtype, device) of the first update

    saved_fields = {
        "method": Linked("method"), "budget": Count(1), "sink": Count(), "window": Count(), "generator": Generator(),
        "scale": Maybe(Real(0.0)), "state": Instance(StreamState), "unrotate": Linked("unrotate"), "head": Maybe(Instance("tokens")),
        "recent": Maybe(Instance("tokens")), "exact": Maybe(Instance("growing_slots", "quantized_slots")),
        "exact_last": Maybe(Instance("tokens")), "seen": Count(),
        "layout": Maybe(Record((Count(1), Count(1), Count(1), Count(1), DType(), Device()))),
    }

    def check_saved(self) -> None:
        fresh = self.method.new_stream(self.budget, torch.Generator(), None if not self.method.stream_recompresses else 0.0)
        if not fresh.same_kind(self.state):
            raise ValueError(f"method {self.method.name!r} streams through a {type(fresh).saved_name}, the file holds a "
                             f"{type(self.state).saved_name}")
        head = self.head.length if self.head is not None else 0
        recent = self.recent.length if self.recent is not None else 0
        if head > self.sink or recent > self.window or head + recent > self.seen:
            raise ValueError(f"{head} sink and {recent} window tokens for a sink of {self.sink}, a window of {self.window} and "
                             f"{self.seen} tokens seen")
        if self.exact is not None and (self.exact.length > self.budget or self.exact.length and self.exact_last is None):
            raise ValueError(f"{self.exact.length} tokens held exactly for a budget of {self.budget}, latest block "
                             f"{'missing' if self.exact_last is None else 'there'}")
        if (self.layout is None) != (self.seen == 0):
            raise ValueError(f"{self.seen} tokens seen with layout {self.layout}")
        if self.layout is not None:
            b, h, d, dv, dtype, _ = self.layout
            for part in (p for p in (self.head, self.recent, self.exact_last) if p is not None):
                if part.keys.shape[:2] != (b, h) or part.keys.shape[-1] != d or part.values.shape[-1] != dv or part.keys.dtype != dtype:
                    raise ValueError(f"tokens {list(part.keys.shape)} {part.keys.dtype} do not match the stream's layout {self.layout}")

    def __copy__(self):
        """Refused: a shallow copy would share the method's state and buffers with the original, so updating one would
        corrupt the other."""
        raise TypeError("a Stream cannot be shallow-copied: the copy would share its state with the original, which updating "
                        "either would corrupt; copy.deepcopy(stream) copies it (and a stream pickles whole)")

    def update(self, keys, values, queries=None, pre_rope_keys=None, positions=None, layer_idx=None, num_layers=None,
               hidden_states=None) -> None:
        """Take the next block: keys/values [B,H_kv,b,d]; queries [B,H_q,q,d] (dropped unless the method's requirements name
        them); positions [b] or [B,H_kv,b], each >= 0 and strictly increasing, past the positions of earlier updates
        (default: the running count of tokens taken, seen .. seen + b - 1, which does not continue from positions given
        before: give them to every update or to none); hidden_states [B,H_kv,b,d_model] or None (`Tokens.hidden_states`:
        held with the tokens, window and buffer alike).

        Every update must have the first one's batch, KV heads, head dims, dtype and device. A batch of several rows is
        refused for a method whose stream would let one row change what another keeps (`batch_coupling`). NaN or inf is a
        ValueError on the CPU and a device-side assertion elsewhere (no host sync per block); positions are checked on the
        CPU only, against the earlier updates where the stream still holds their latest token exactly (in its window, or
        its sink).
        """
        check_kv(keys, values, queries, pre_rope_keys, sync=False, hidden_states=hidden_states)
        if (layer_idx is None) != (num_layers is None):
            raise ValueError(f"layer_idx and num_layers must be given together, got layer_idx={layer_idx!r}, num_layers={num_layers!r}")
        if layer_idx is not None:
            check_layer((layer_idx, num_layers))
        if not self.method.requirements.needs("queries"):
            queries = None  # held with the latest block until the next one (and saved with it): only for a method that reads them
        b, h, n, d = keys.shape
        layout = (b, h, d, values.shape[-1], keys.dtype, keys.device)
        if self.layout is None:
            coupled = batch_coupling(self.method, b)
            if coupled is not None:
                raise ValueError(f"stream.update: method {self.method.name!r} {coupled}: stream one row at a time (keys [1, H_kv, b, d]), "
                                 "or use kvc.compress, which compresses each row alone")
            self.layout = layout
        elif layout != self.layout:
            fb, fh, fd, fdv, fdtype, fdevice = self.layout
            raise ValueError(
                f"stream.update: keys {describe(keys)} / values {describe(values)} do not match the earlier updates: every update must have "
                f"batch {fb}, {fh} KV heads, key dim {fd}, value dim {fdv}, dtype {str(fdtype).removeprefix('torch.')}, device {fdevice}"
            )
        if positions is None:
            positions = torch.arange(self.seen, self.seen + n, device=keys.device)
        # values read on the CPU only: elsewhere that would be a device sync per streamed block
        on_cpu = isinstance(positions, torch.Tensor) and positions.device.type == "cpu"
        check_positions(positions, keys, ordered=on_cpu, nonnegative=on_cpu)
        positions = positions.to(device=keys.device, dtype=torch.long).expand(b, h, n)
        latest = self._latest_exact_positions() if on_cpu else None
        if latest is not None and not bool((positions[..., 0] > latest).all()):
            raise ValueError(f"positions must continue past the tokens the stream took before: this block starts at "
                             f"{int(positions[..., 0].min())}, the stream holds position {int(latest.max())}; give every update the "
                             f"positions that follow the last one's, or give none (the running count of tokens)")
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(d)
        qpos = query_positions_for(queries, positions)
        block = Tokens(keys, values, positions, queries, pre_rope_keys, scale, layer_idx, num_layers, qpos, unrotate=self.unrotate,
                       hidden_states=hidden_states)
        block = self.method.on_entry(block)
        # the block's place is worked out first and kept only once the method has accepted what leaves the window: a
        # refused block leaves the stream as it was
        head, recent = self.head, self.recent
        take = min(self.sink - (head.length if head is not None else 0), n)
        if take > 0:
            part = block.slice(0, take).stored()
            head = part if head is None else cat_tokens([head, part])
            block = block.slice(take, n)
        leaving = None
        if block.length:
            recent = block if recent is None or recent.length == 0 else cat_tokens([recent, block])
            overflow = recent.length - self.window
            if overflow > 0:
                staying = recent.slice(overflow, recent.length)
                leaving = replace(recent.slice(0, overflow), queries=queries, query_positions=qpos)
                if queries is not None:  # the exact neighbours share the queries' softmax: only a method that reads them
                    exact = [p for p in (head, staying) if p is not None]
                    leaving = replace(leaving, exact_keys=torch.cat([p.keys for p in exact], 2),
                                      exact_positions=torch.cat([p.positions for p in exact], 2))
                self.method.check_inputs(leaving)
                recent = staying
            recent = recent.stored()
        self.seen, self.head, self.recent = self.seen + n, head, recent
        if leaving is not None:
            self._absorb(leaving)

    def _latest_exact_positions(self) -> torch.Tensor | None:
        """Positions [B, H_kv] of the latest token the stream took, where it holds that token exactly (its window, or its sink
        while nothing has passed it); None before the first update, or when the latest token went to the middle (window 0)."""
        if self.recent is not None and self.recent.length:
            return self.recent.positions[..., -1]
        if self.head is not None and self.head.length == self.seen:
            return self.head.positions[..., -1]
        return None

    def _absorb(self, leaving: Tokens) -> None:
        """Hold `leaving` exactly while at most `budget` tokens have left the window; past that, hand
        everything held, then each later block, to the method's state."""
        if self.exact is None:
            self.state.absorb(leaving)
            return
        if self.exact.length + leaving.length <= self.budget:
            append_columns(self.exact, token_columns(leaving), most=self.exact.length + leaving.length)
            self.exact_last = leaving.scoring_context(self.method.queries_read)  # its keys and values are in the buffer
            return
        # past the budget: what is held and the block go to the state together (the buffer never holds more than budget)
        slots, self.exact, self.exact_last = self.exact, None, None
        held = cat_tokens([tokens_from_columns(leaving, slots.view()), leaving]) if slots.length else leaving
        if isinstance(slots, QuantizedSlots):  # the held tokens keep the codes they were stored with
            self.state.absorb(held, codes=slots)
        else:
            self.state.absorb(held)

    def exact_tokens(self) -> Tokens:
        """The tokens held exactly, with the latest block's queries and exact neighbours."""
        return tokens_from_columns(self.exact_last, self.exact.view())

    def summary(self) -> KVSummary:
        """Sink, then the middle (the method's summary, or the tokens held exactly), then the window."""
        return concat_parts(self.summary_parts())

    def summary_parts(self) -> list[KVSummary]:
        """`summary()` as the parts it concatenates (`StreamState.summary_parts`)."""
        parts = [p.exact() for p in (self.head,) if p is not None]
        if self.exact is None:
            parts += self.state.summary_parts()
        elif self.exact.length:
            parts.append(self.exact_tokens().exact())
        if self.recent is not None and self.recent.length > 0:
            parts.append(self.recent.exact())
        if not parts:
            raise ValueError("the stream has seen no tokens yet")
        return parts

    def compact(self) -> None:
        """Compact the method's state now (`StreamState.compact`: the room reserved for later tokens given back; a
        no-op while the tokens are held exactly)."""
        if self.exact is None:
            self.state.compact()

    def nbytes(self) -> int:
        """KV bytes of the sink, the window and the middle (exact, or the method's state)."""
        exact = sum(p.exact().nbytes() for p in (self.head, self.recent) if p is not None)
        return exact + (self.state.nbytes() if self.exact is None else self.exact.kv_bytes())
