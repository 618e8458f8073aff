"""The public tensor-level functions: compress() and stream() (docs/design.md, "Public API"); `kvc.methods()`, the list
of registered methods, is the callable package `kvcompress.methods`."""

from __future__ import annotations

import math

import torch

from . import methods as _methods  # noqa: F401  (registers every method)
from .checks import as_seed, check_kv, check_layer, check_positions, check_scale
from .methods.base import compress_tokens, make_generator
from .methods.budget import check_sink_window, resolve_budget
from .methods.registry import build_method, default_sink_window
from .methods.stream import Stream
from .methods.tokens import Tokens, query_positions_for
from .quantization import check_storage
from .summary import KVSummary


SIZE_SETTINGS = ("budget", "compression_ratio", "sink", "window")


def compress(
    method: str,
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None = None,
    *,
    pre_rope_keys: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    scale: float | None = None,
    layer: tuple[int, int] | None = None,
    seed: int | torch.Generator | None = 0,
    hidden_states: torch.Tensor | None = None,
    **settings,
) -> KVSummary:
    """One-shot compression of one layer's keys/values [B, H_kv, n, d] into a KVSummary.

    settings: exactly one of `budget` (middle slots kept per head; sink and window are extra and
    exact) or `compression_ratio` (fraction of the n tokens removed; an error when it would remove
    tokens but sink + window leave no room); `sink` / `window` (default: the method's own,
    `default_sink` / `default_window`, listed in docs/methods.md); any other name is a parameter
    of the method. queries [B, H_q, n_q, d] post-RoPE for query-aware methods; pre_rope_keys [B, H_kv, n, d] for Compactor and the hybrid;
    hidden_states [B, H_kv, n, d_model] (each token's hidden state at the layer's input) for KVzap.
    Each input is checked (shapes, device, finite values) whether or not the method reads it; one it does not read
    (`requirements.inputs`: queries for KnormPress, hidden states for SnapKV, `layer` for most) is then not used, so a
    caller can hand every method the same inputs; one it reads and was not given is an error naming it (once there is
    a middle to compress).
    positions [n] or [B, H_kv, n] (>= 0, increasing; the same in every row and head for a method that reads queries)
    default to 0..n-1. layer: (layer_idx, num_layers), for a
    method that depends on the layer (PyramidKV). seed: an int from 0 to 2**63 - 1
    (reproducible), a torch.Generator, or None for fresh randomness (a different draw each call). The rows of a
    batch share it: a randomized method's row is a draw of its own tokens, reproducible for the same batch and seed,
    not the draw that row gets alone (a cache, whose rows answer as alone, draws each row from its own generator).
    """
    size = {name: settings.pop(name, None) for name in SIZE_SETTINGS}
    m = build_method(method, **settings)
    sink, window = check_sink_window(*default_sink_window(method, size["sink"], size["window"]))
    check_kv(keys, values, queries, pre_rope_keys, hidden_states=hidden_states)
    b, h, n, d = keys.shape
    middle_budget = resolve_budget(n, size["budget"], size["compression_ratio"], sink, window)
    if positions is None:
        positions = torch.arange(n, device=keys.device)
    check_positions(positions, keys)
    positions = positions.to(device=keys.device, dtype=torch.long).expand(b, h, n)
    scale = check_scale(scale)
    s = 1.0 / math.sqrt(d) if scale is None else scale
    layer_idx, num_layers = check_layer(layer)
    generator = _generator(seed, keys.device)
    if not m.requirements.needs("queries"):
        queries = None  # a method that does not read them takes none (and no causal mask over positions)
    tokens = Tokens(keys, values, positions, queries, pre_rope_keys, s, layer_idx, num_layers, query_positions_for(queries, positions),
                    hidden_states=hidden_states)
    return compress_tokens(m, tokens, middle_budget, sink, window, generator)


def stream(
    method: str,
    budget: int,
    sink: int | None = None,
    window: int | None = None,
    seed: int | torch.Generator | None = 0,
    scale: float | None = None,
    slack: float | None = None,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    **method_params,
) -> Stream:
    """A streaming compressor: `.update(keys, values, queries=None)` any number of times, `.summary()`.

    Besides the exact sink and window, every method's stream stores at most `budget` slots per head
    at every step, the block in progress included (AdaKV's: H_kv·budget per batch row; PyramidKV's
    lower layers keep more): Express and SubGen by construction; a block-wise method (score methods,
    Compactor, the hybrid), ClusterGen's run-wise stream and BalanceKV's (halvings wait by the slack)
    take their slack and the block out of the budget (`methods.budget.stream_split`), compressing
    back to a target (block-wise: floor(budget / (1 + slack)) slots) each time the next tokens do not
    fit, so the cost is linear in the stream length. slack: None is DEFAULT_SLACK (0.5: back to 2/3
    of the budget), 0 keeps one slot of room (a re-compression at every token once the budget is
    full); `.compact()` gives back the room reserved for later tokens. seed as in `compress` (None:
    fresh randomness). kv_bits (8, 4, 2; kv_group_size, default 32): the method's state
    stores its slots quantized, each once, keys and values per slot (a block-wise buffer of codes,
    `quantization.QuantizedSlots`; a native stream's tensors through `methods.base.QuantizedState`).
    """
    m = build_method(method, **method_params)
    sink, window = default_sink_window(method, sink, window)
    kv_bits, kv_group_size = check_storage(kv_bits, kv_group_size)
    return Stream(m, budget, sink, window, _generator(seed), scale, slack, kv_bits=kv_bits, kv_group_size=kv_group_size)


def _generator(seed: int | torch.Generator | None, device: torch.device | str = "cpu") -> torch.Generator:
    """`make_generator` of a caller's seed: an int from 0 to `names.MAX_SEED`, as every other entry point takes."""
    return make_generator(seed if seed is None or isinstance(seed, torch.Generator) else as_seed(seed), device)
