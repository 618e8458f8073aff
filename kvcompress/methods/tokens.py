"""The token bundle every method reads (`Tokens`) and the helpers that cut, join and store it.

A method sees only a layer's compressible middle (sink and window are handled for it) as a
`Tokens`: keys, values, positions, and the queries, pre-RoPE keys, scale and exact neighbours
it may need. Streams store a bundle's per-token tensors as columns (`token_columns`) and rebuild
it from them (`tokens_from_columns`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..attention import received_attention
from ..quantization import QuantizedSlots
from ..saved_state import Count, Linked, Maybe, Real, Saveable, Tensor, saved
from ..summary import KVSummary, _GrowingSlots, take_slots


@saved("tokens", version=2)  # 2: hidden_states
@dataclass
class Tokens(Saveable):
    """Exact tokens handed to a method.

    keys [B,H_kv,n,d] (post-RoPE), values [B,H_kv,n,d_v], positions [B,H_kv,n] (int64),
    queries [B,H_q,n_q,d] or None (the most recent queries seen with these tokens, post-RoPE),
    pre_rope_keys [B,H_kv,n,d] or None, scale (attention scale s), layer_idx / num_layers when
    called from a model (PyramidKV uses them), query_positions [n_q] (original positions of the
    queries, for causal scoring; None means the queries follow every token), exact_keys
    [B,H_kv,m,d] / exact_positions [B,H_kv,m]: the tokens kept exactly beside these (sink and
    window), which share the queries' softmax with them (None: no such tokens).
    attention_mass [B,H_kv,n] float32 or None: the mass each token received from the queries, as
    `attention_mass(tokens)` would compute it, when the model's own attention computed it as a
    by-product (`integration.attention.causal_attention_with_mass`); `slice` and `cat_tokens`
    carry it along, anything that selects tokens otherwise must drop or select it too.
    unrotate: a function (keys [B,H_kv,m,d], positions [B,H_kv,m]) -> pre-RoPE keys, given by a cache
    that can invert its model's rotation; a stream then stores no pre-RoPE keys and `pre_rope()`
    computes them when a method needs them.
    extra_lse [B,H_q,n_q] float32 or None: per query, the log of Σ exp(s<q,k>) over keys it also
    attends to that are neither these tokens nor `exact_keys` (KVzip's reconstruction forward: the
    queries' own causal keys), so a method's softmax normaliser includes them (None: no such keys).
    hidden_states [B,H_kv,n,d_model] (the model's dtype) or None: for each token, the hidden state the layer's
    attention module received (after the layer's input norm), handed over only to a method that reads it
    (`Requirements.inputs` "hidden_states"). Per KV head because a stream's heads keep different tokens: from the
    model it is one [B, n, d_model] tensor broadcast over the heads (`per_head`, no copy), while a stream's buffer
    stores it per head like any other column (H_kv·d_model more elements per token held, counted in its bytes).
    `slice`, `select` and `cat_tokens` carry it along.
    entry_scores [B,H_kv,n] float32 or None: scores a method gave each token when it entered a stream
    (`Method.on_entry`), from inputs the stream then need not keep (KVzap's, from the hidden states): a per-token
    scalar stored beside the positions, like them bookkeeping rather than KV bytes.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    queries: torch.Tensor | None = None
    pre_rope_keys: torch.Tensor | None = None
    scale: float = 1.0
    layer_idx: int | None = None
    num_layers: int | None = None
    query_positions: torch.Tensor | None = None
    exact_keys: torch.Tensor | None = None
    exact_positions: torch.Tensor | None = None
    attention_mass: torch.Tensor | None = None
    unrotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    extra_lse: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    entry_scores: torch.Tensor | None = None

    saved_fields = {
        "keys": Tensor("B H n D"), "values": Tensor("B H n V"), "positions": Tensor("B H n", ("int64",)),
        "queries": Maybe(Tensor("B Q q D")), "pre_rope_keys": Maybe(Tensor("B H n D")), "scale": Real(0.0),
        "layer_idx": Maybe(Count()), "num_layers": Maybe(Count(1)), "query_positions": Maybe(Tensor("q", ("int64",))),
        "exact_keys": Maybe(Tensor("B H e D")), "exact_positions": Maybe(Tensor("B H e", ("int64",))),
        "attention_mass": Maybe(Tensor("B H n")), "unrotate": Linked("unrotate"), "extra_lse": Maybe(Tensor("B Q q")),
        "hidden_states": Maybe(Tensor("B H n M")), "entry_scores": Maybe(Tensor("B H n", ("float32",))),
    }

    @classmethod
    def from_saved(cls, values):
        return cls(**values)

    def check_saved(self) -> None:
        if (self.layer_idx is None) != (self.num_layers is None) or (self.layer_idx is not None and self.layer_idx >= self.num_layers):
            raise ValueError(f"layer_idx {self.layer_idx} does not fit num_layers {self.num_layers}")
        if (self.exact_keys is None) != (self.exact_positions is None):
            raise ValueError("exact_keys and exact_positions come together")

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def slice(self, start: int, stop: int) -> "Tokens":
        """Tokens start:stop along the token axis (queries kept as they are)."""
        pre = self.pre_rope_keys[:, :, start:stop] if self.pre_rope_keys is not None else None
        mass = self.attention_mass[:, :, start:stop] if self.attention_mass is not None else None
        hidden = self.hidden_states[:, :, start:stop] if self.hidden_states is not None else None
        entry = self.entry_scores[:, :, start:stop] if self.entry_scores is not None else None
        return replace(
            self,
            keys=self.keys[:, :, start:stop],
            values=self.values[:, :, start:stop],
            positions=self.positions[:, :, start:stop],
            pre_rope_keys=pre,
            attention_mass=mass,
            hidden_states=hidden,
            entry_scores=entry,
        )

    def exact(self) -> KVSummary:
        return KVSummary.exact(self.keys, self.values, self.positions)

    def stored(self) -> "Tokens":
        """These tokens as a stream keeps them between updates (its sink and window, a state's waiting tokens): each
        per-token tensor in storage of its own, since a view would hold the whole block it came from, and neither the
        queries nor the exact neighbours, which score only the block being absorbed."""
        def owned(t):
            return t.clone() if t is not None else None

        return replace(self, keys=owned(self.keys), values=owned(self.values), positions=owned(self.positions),
                       pre_rope_keys=owned(self.pre_rope_keys), attention_mass=owned(self.attention_mass),
                       hidden_states=owned(self.hidden_states), entry_scores=owned(self.entry_scores), queries=None,
                       query_positions=None, exact_keys=None, exact_positions=None, extra_lse=None)

    def scoring_context(self, queries_read: int | None = None) -> "Tokens":
        """What a stream state keeps of its latest block to score the tokens it holds (`tokens_from_columns`): the
        block's queries (only the last `queries_read`, copied, when the method reads no more: `Method.queries_read`),
        exact neighbours and settings, its per-token columns emptied (0 tokens, fresh storage, their other dimensions
        kept, so which columns a block stores is still known): the block's keys and values are held in the state's
        slots, not a second time here."""
        def emptied(t):
            return t[:, :, :0].clone() if t is not None else None

        queries, query_positions, extra_lse = self.queries, self.query_positions, self.extra_lse
        if queries is not None and queries_read is not None and queries_read < queries.shape[2]:
            queries = queries[:, :, -queries_read:].clone()
            query_positions = query_positions[-queries_read:].clone() if query_positions is not None else None
            extra_lse = extra_lse[:, :, -queries_read:].clone() if extra_lse is not None else None
        return replace(self, keys=emptied(self.keys), values=emptied(self.values), positions=emptied(self.positions),
                       pre_rope_keys=emptied(self.pre_rope_keys), hidden_states=emptied(self.hidden_states),
                       entry_scores=emptied(self.entry_scores), queries=queries, query_positions=query_positions,
                       extra_lse=extra_lse)

    def select(self, index: torch.Tensor, keys_values: bool = True) -> "Tokens":
        """The tokens at `index` [B,H,k] of each head. A given attention mass is dropped: it was normalised
        over all the tokens, so a later score method computes the subset's own. keys_values=False (for a
        method whose `reads_keys_values` is False): keys and values are empty [B,H,k,0] placeholders."""
        pre = take_slots(self.pre_rope_keys, index) if self.pre_rope_keys is not None else None
        hidden = take_slots(self.hidden_states, index) if self.hidden_states is not None else None
        entry = take_slots(self.entry_scores, index) if self.entry_scores is not None else None
        if keys_values:
            keys, values = take_slots(self.keys, index), take_slots(self.values, index)
        else:
            keys, values = self.keys.new_empty((*index.shape, 0)), self.values.new_empty((*index.shape, 0))
        return replace(self, keys=keys, values=values, positions=take_slots(self.positions, index), pre_rope_keys=pre, attention_mass=None,
                       hidden_states=hidden, entry_scores=entry)

    def pre_rope(self) -> torch.Tensor | None:
        """Pre-RoPE keys [B,H_kv,n,d]: the given ones, else computed by `unrotate` (None without either)."""
        if self.pre_rope_keys is not None or self.unrotate is None:
            return self.pre_rope_keys
        return self.unrotate(self.keys, self.positions)


def cat_tokens(parts: list[Tokens]) -> Tokens:
    """Concatenate token bundles along the token axis; queries from the last part; pre-RoPE keys, attention mass,
    hidden states and entry scores when every part has them (else None)."""
    last = parts[-1]
    pre = mass = hidden = entry = None
    if all(p.pre_rope_keys is not None for p in parts):
        pre = torch.cat([p.pre_rope_keys for p in parts], 2)
    if all(p.attention_mass is not None for p in parts):
        mass = torch.cat([p.attention_mass for p in parts], 2)
    if all(p.hidden_states is not None for p in parts):
        hidden = torch.cat([p.hidden_states for p in parts], 2)
    if all(p.entry_scores is not None for p in parts):
        entry = torch.cat([p.entry_scores for p in parts], 2)
    return replace(
        last,
        keys=torch.cat([p.keys for p in parts], 2),
        values=torch.cat([p.values for p in parts], 2),
        positions=torch.cat([p.positions for p in parts], 2),
        pre_rope_keys=pre,
        attention_mass=mass,
        hidden_states=hidden,
        entry_scores=entry,
    )


def per_head(hidden_states: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """hidden_states [B, n, d_model] as `Tokens.hidden_states` takes them, [B, heads, n, d_model] (a broadcast view, no
    copy); None stays None."""
    return None if hidden_states is None else hidden_states.unsqueeze(1).expand(-1, heads, -1, -1)


def token_columns(tokens: Tokens) -> tuple[torch.Tensor, ...]:
    """The per-token tensors [B,H,n,...] a stream stores: keys, values, positions, pre-RoPE keys when given (not when
    `tokens.unrotate` can recompute them), hidden states and entry scores when given."""
    columns = [tokens.keys, tokens.values, tokens.positions]
    if tokens.pre_rope_keys is not None and tokens.unrotate is None:
        columns.append(tokens.pre_rope_keys)
    if tokens.hidden_states is not None:
        columns.append(tokens.hidden_states)
    if tokens.entry_scores is not None:
        columns.append(tokens.entry_scores)
    return tuple(columns)


def append_columns(slots: _GrowingSlots | QuantizedSlots, columns: tuple[torch.Tensor, ...], **allocation) -> None:
    """Append a block's `token_columns` (plus any extra ones) to a buffer (`_GrowingSlots.append` options)."""
    if slots.length and len(columns) != slots.width:
        raise ValueError("a stream's updates must all pass pre_rope_keys (and hidden_states) or all leave them out")
    slots.append(columns, **allocation)


def tokens_from_columns(last: Tokens, columns: tuple[torch.Tensor, ...]) -> Tokens:
    """The tokens whose `token_columns` (and extra columns after them) are `columns`, with the latest
    block's queries and exact neighbours (`last`)."""
    keys, values, positions, *extra = columns
    pre = extra.pop(0) if last.pre_rope_keys is not None and last.unrotate is None else None
    hidden = extra.pop(0) if last.hidden_states is not None else None
    entry = extra.pop(0) if last.entry_scores is not None else None
    return replace(last, keys=keys, values=values, positions=positions, pre_rope_keys=pre, hidden_states=hidden, entry_scores=entry)


def query_positions_for(queries: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor | None:
    """Positions [n_q] of queries that came with tokens at `positions` [B,H,n]: the last n_q of them (None if n_q > n).
    Queries take one set of positions, so tokens placed differently in different rows or heads (positions given as
    [B, H_kv, n] that differ) are a ValueError: such rows are compressed one at a time. Positions expanded from [n]
    are not read (no host sync)."""
    if queries is None or queries.shape[2] > positions.shape[2]:
        return None
    b, h, _ = positions.shape
    if ((b > 1 and positions.stride(0)) or (h > 1 and positions.stride(1))) and \
            not torch.equal(positions, positions[:1, :1].expand_as(positions)):
        raise ValueError("positions differ between batch rows or KV heads, and the queries a method scores with take one set of "
                         "positions (their causal mask): give positions [n], or compress rows with other positions one at a time")
    return positions[0, 0, positions.shape[2] - queries.shape[2] :]


def exact_ends(n: int, sink: int, window: int) -> tuple[int, int]:
    """(sink, window): how many of n tokens the exact sink and the exact window take (the sink first; together at most n)."""
    head = min(sink, n)
    return head, n - max(head, n - window)


def split_exact(tokens: Tokens, sink: int, window: int) -> tuple[Tokens, Tokens, Tokens]:
    """(sink tokens, middle, window tokens) of a token bundle (`exact_ends`)."""
    n = tokens.length
    head, tail = exact_ends(n, sink, window)
    return tokens.slice(0, head), tokens.slice(head, n - tail), tokens.slice(n - tail, n)


def positions_index(all_positions: torch.Tensor, kept_positions: torch.Tensor) -> torch.Tensor:
    """Index into the token axis of `all_positions` [B,H,n] of each kept position [B,H,k] (both ascending)."""
    return torch.searchsorted(all_positions.contiguous(), kept_positions.contiguous())


def attention_mass(tokens: Tokens, last: int | None = None, average: str = "group", max_logits: int = 1 << 22) -> torch.Tensor:
    """[B, H_kv, n]: the attention the (last `last`) queries of `tokens` give each token, with the sink and window
    (`tokens.exact_keys`) in the softmax and causal masking by `query_positions` (`attention.received_attention`)."""
    queries, qpos = tokens.queries, tokens.query_positions
    if last is not None:
        queries = queries[:, :, -last:]
        qpos = qpos[-last:] if qpos is not None else None
    return received_attention(queries, tokens.keys, tokens.positions, tokens.scale, qpos, tokens.exact_keys, tokens.exact_positions,
                              average, max_logits)
