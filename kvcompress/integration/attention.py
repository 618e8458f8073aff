"""The 'kvcompress' attention function, registered with transformers' AttentionInterface.

docs/design.md, "Model integration: three modes".
"""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ..attention import LOG2_E, exp_rows_, log2_range, packed_then_causal_attention, totals_in_range, weighted_attention
from ..checks import as_count
from ..model_support import ATTENTION_NAME, attention_modules, autocast_off, has_padding, keep_hidden_states, release_hidden_states
from ..model_support import take_hidden_states
from ..ragged import concat_parts


def kvcompress_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [B,H_q,q,d], key/value as a CompressedCache layer returned them -> ([B,q,H_q,d], None).

    Over a CompressedCache layer: weighted attention over its view (log-weights as a bias, causal
    by original positions, padding slots ignored; packed slots read where they are stored,
    `packed_then_causal_attention`), then the layer absorbs the new block with these queries.
    Without one (a sliding-window layer, no cache, a plain forward) the keys are exact and
    the model's mask applies (`exact_attention_with_mask`). In the stored dtype (autocast off); without soft-capping,
    causality comes from the view's layout (`causal_tail`: the block is its last slots), so a decode
    step reads no tensor value on the host. No attention weights are returned: output_attentions=True warns
    (`NO_ATTENTION_WEIGHTS`). A model in training mode with attention dropout gets it on the exact path; over a
    compressed layer or with soft-capping, which have none, it is refused (`refuse_dropout`). A forward over a
    compressed layer with use_cache=False (as the model passes it down) is refused (`USE_CACHE_OFF`).
    """
    layer = getattr(key, "kvcompress_layer", None)
    softcap = kwargs.pop("softcap", None)
    if kwargs.pop("output_attentions", False):
        warnings.warn(NO_ATTENTION_WEIGHTS, stacklevel=2)
    hidden_states = take_hidden_states(module)  # kept by `keep_hidden_states` in this thread, for this forward only
    if layer is not None or softcap is not None:
        refuse_dropout(dropout, "the 'kvcompress' attention over a compressed layer or with soft-capping")
    if layer is None:
        return exact_attention_with_mask(module, query, key, value, attention_mask, scaling, softcap, dropout=dropout, **kwargs)
    if kwargs.get("use_cache") is False:
        raise ValueError(USE_CACHE_OFF)
    layer.mask_padding(attention_mask, kwargs.get("position_ids"))
    # in the stored dtype, under torch.autocast too: the attention over a summary and the compression of the block
    # compute in their own precision (their logits, masses and scores assume it), not in the autocast dtype
    with autocast_off(query.device):
        return _over_compressed_layer(layer, query.to(layer.dtype), scaling, softcap, hidden_states)


def _over_compressed_layer(layer, query, scaling, softcap, hidden_states):
    """`kvcompress_attention` over a CompressedLayer's view (its packed slots, then the view), then the layer absorbs
    the block."""
    view, packed = layer.view, layer.view_packed
    progress = layer.cache.progress
    mass = None
    if softcap is None and _compresses_with_attention_mass(layer):
        if query.requires_grad:  # a forward with gradients on: the output by the differentiable path, the mass without
            out = weighted_attention(query, view, scaling, causal_tail=True)
            with torch.no_grad():
                mass = causal_attention_with_mass(query, view.keys, view.values, scaling)[1]
        else:
            out, mass = causal_attention_with_mass(query, view.keys, view.values, scaling)
    elif softcap is None and packed:
        out = packed_then_causal_attention(query, packed, view, scaling)
    elif softcap is None:
        out = weighted_attention(query, view, scaling, causal_tail=True)
    else:
        query_positions = torch.arange(layer.seen - query.shape[2], layer.seen, device=query.device)
        out = softcapped_weighted_attention(query, concat_parts([*packed, view]), scaling, softcap, query_positions)
    layer.commit(query, scaling, attention_mass=mass, hidden_states=hidden_states)
    if progress is not None:
        progress.update(1)
    return out.transpose(1, 2).contiguous(), None


def refuse_dropout(dropout: float, what: str) -> None:
    """ValueError for a nonzero attention dropout (a model in training mode whose config sets one), which `what` has not."""
    if dropout:
        raise ValueError(f"attention dropout={dropout} (the model is in training mode and its config sets attention_dropout): "
                         f"{what} has no dropout; call model.eval(), or set the model's attention_dropout to 0")


USE_CACHE_OFF = (
    "a CompressedCache was given to a forward with use_cache=False: transformers then feeds the whole sequence again at "
    "every generation step, and the cache would store every token again each time (more than the full cache holds, "
    "nothing compressed); generate or run the model with use_cache=True, the default (and a new cache, or cache.reset())"
)
NO_ATTENTION_WEIGHTS = (
    "output_attentions=True: the 'kvcompress' attention returns no attention weights (as SDPA returns none), so the "
    "attentions come back empty; a CompressedCache built by name set the model to it. For the weights, run the model "
    "without a CompressedCache after model.set_attn_implementation('eager')"
)


def _compresses_with_attention_mass(layer) -> bool:
    """True when this forward is the layer's one-shot prefill compression (prefill mode, nothing
    stored yet, no padding) and its method scores with the full attention mass
    (`Requirements.inputs` "attention_mass"): the attention then goes through `causal_attention_with_mass`."""
    options = layer.cache.options
    return (  # the cheap checks first: a decode step stops at the first
        layer.front is None
        and options.mode == "prefill"
        and options.compressor.requirements.needs("attention_mass")
        and not has_padding(layer.pending_real)
    )


class feeding_hidden_states:
    """Context manager: while active, every attention module of `model` keeps the hidden states it receives
    (`model_support.keep_hidden_states`) until the 'kvcompress' attention function of the same forward takes them and
    hands them to the cache layer with the block (`CompressedLayer.commit`, `Tokens.hidden_states`). The model
    integration enters it while a method that reads hidden states runs (`Requirements.inputs`); the hooks are removed on
    exit."""

    def __init__(self, model):
        self.model = model
        self.handles = []

    def __enter__(self):
        self.handles = keep_hidden_states(self.model)
        return self

    def __exit__(self, *exc):
        release_hidden_states(self.handles)
        for module in attention_modules(self.model):  # a forward that stopped before its attention took them
            take_hidden_states(module)
        return False


_MAX_WORKERS = 4


def causal_attention_with_mass(
    query, key, value, scale: float | None, query_chunk: int | None = None, max_logits: int = 1 << 24, workers: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention and, as a by-product, the attention mass every key receives.

    query [B,H_q,q,d], key/value [B,H_kv,n,d] / [B,H_kv,n,d_v] with n >= q: query i sees keys
    0 .. n - q + i (the queries are the last q tokens); scale None is 1/sqrt(d). Returns
    (out [B,H_q,q,d_v] in the query's dtype, mass [B,H_kv,n] float32): mass[j] = Σ_i
    softmax_i(s<q_i,k>)[j] summed over the queries and averaged over each GQA group, exactly what
    `methods.tokens.attention_mass` returns for these queries on these keys. An explicit softmax in
    float32 (any input dtype; base-2 exponentials, `attention.LOG2_E` folded into the scale),
    `query_chunk` queries at a time (default 32 on the CPU, 64 elsewhere; fewer if the workers'
    scores would exceed `max_logits`, 64 MiB), future keys never multiplied.
    Every query sees at least its own key, so no row is empty. The logits are exponentiated without a
    max shift first (a model's logits lie far inside float32's range); if a row's total left the
    range `attention.exp_rows_` trusts (an exponential or the total overflowed, or the total
    underflowed), the whole call is redone with every row max-shifted (`totals_in_range`, one host
    read per call, at the end).

    Head blocks: on the CPU a chunk's scores are formed one KV head (of one sequence) at a time, in
    one reused workspace per worker of chunk x group x n scores (0.4 MiB per 1k keys for 32 queries
    and 3 query heads per KV head), so the passes after the product (mask, exponentials, totals,
    mass, values) find them in the core's cache (on the default model's 4k-token q/k/v, one thread,
    its time over SDPA's summed over the layers fell by 6-10 % against every head at once; its time beyond
    SDPA's in a whole prefill is the cost bench's `fused_extra_s`, docs/results.md). On other
    devices every head of the chunk is one batched product (fewer, larger kernels). The outputs are
    scaled by their rows' reciprocal totals once, at the end.

    workers: on the CPU, the chunks are dealt round-robin to this many threads (default: torch's
    intra-op thread count, at most 4), which share torch's threads evenly as their intra-op threads
    (at least one each; `_in_worker`), their masses summed in worker order; on other devices
    (default 1) the chunks run in order on the calling thread. The cap keeps each worker's chunks
    large where many cores would otherwise split them into a few queries each (its value is not
    tuned beyond 2 cores). These skinny GEMMs (inner dimension d) gain more from independent chunks
    on separate threads than from a second intra-op thread on one chunk.
    """
    b, hq, nq, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    group = hq // hkv
    scale = d**-0.5 if scale is None else scale
    work = torch.promote_types(query.dtype, torch.float32)
    # query-major rows: a chunk's queries of one KV head are one contiguous [c·group, d] matrix
    q = (query.to(work) * (scale * LOG2_E)).reshape(b * hkv, group, nq, d).transpose(1, 2).contiguous()  # [B·H_kv, q, group, d]
    k, v = key.to(work).flatten(0, 1), value.to(work).flatten(0, 1)  # [B·H_kv, n, d | d_v]
    on_cpu = query.device.type == "cpu"
    heads_per_block = 1 if on_cpu else b * hkv
    if workers is None:
        workers = min(torch.get_num_threads(), _MAX_WORKERS) if on_cpu else 1
    workers = as_count("workers", workers, 1)
    query_chunk = as_count("query_chunk", (32 if on_cpu else 64) if query_chunk is None else query_chunk, 1)
    chunk = max(1, min(query_chunk, max_logits // max(1, workers * heads_per_block * group * n)))
    starts = range(0, nq, chunk)
    workers = min(workers, len(starts))
    out = torch.empty(b * hkv, nq, group, value.shape[-1], dtype=work, device=query.device)
    inverse = torch.empty(b * hkv, nq, group, dtype=work, device=query.device)  # 1 / each row's total
    parts = [starts[i::workers] for i in range(workers)]
    mass = _attend_in_parts(q, k, v, out, inverse, parts, chunk, heads_per_block, shifted=False)
    if not totals_in_range(log2_range(inverse)):
        mass = _attend_in_parts(q, k, v, out, inverse, parts, chunk, heads_per_block, shifted=True)
    out = out.mul_(inverse[..., None]).unflatten(0, (b, hkv)).permute(0, 1, 3, 2, 4).reshape(b, hq, nq, -1)
    return out.to(query.dtype), (mass / group).reshape(b, hkv, n).float()


def _attend_in_parts(q, k, v, out, inverse, parts: list[range], chunk: int, heads_per_block: int, shifted: bool) -> torch.Tensor:
    """`_attend_chunks` of each part of the chunk starts, in this thread for one part, else one worker
    thread each (`_in_worker`). Returns the mass summed over the parts in order."""
    args = (q, k, v, out, inverse, chunk, heads_per_block, shifted)
    if len(parts) == 1:
        return _attend_chunks(parts[0], *args)
    threads, grad, inference = torch.get_num_threads(), torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    each = max(1, threads // len(parts))
    with ThreadPoolExecutor(len(parts)) as pool:
        calls = [pool.submit(_in_worker, each, threads, grad, inference, _attend_chunks, part, *args) for part in parts]
        masses = [call.result() for call in calls]
    for part_mass in masses[1:]:
        masses[0] += part_mass
    return masses[0]


def _attend_chunks(starts, q, k, v, out, inverse, chunk: int, heads_per_block: int, shifted: bool) -> torch.Tensor:
    """The chunks of `causal_attention_with_mass` beginning at `starts`, `heads_per_block` KV heads at a time:
    q [B·H_kv,q,group,d] (scaled), k/v [B·H_kv,n,d|d_v]; these queries' unnormalised outputs are written into
    out [B·H_kv,q,group,d_v] and the reciprocals of their rows' totals into inverse [B·H_kv,q,group]; rows
    max-shifted if `shifted` (`attention.exp_rows_`). Returns the mass [B·H_kv,n] these queries hand out,
    summed over the group."""
    heads, nq, group, d = q.shape
    n, dv = k.shape[1], v.shape[-1]
    offset = n - nq
    hidden = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)[:, None]  # [query, 1, key]: key after its query
    workspace = torch.empty(heads_per_block * min(chunk, nq) * group * n, dtype=q.dtype, device=q.device)
    mass = torch.zeros(heads, 1, n, dtype=q.dtype, device=q.device)
    for start in starts:
        stop = min(nq, start + chunk)
        c, seen = stop - start, offset + stop
        rows = c * group
        for lo in range(0, heads, heads_per_block):
            hi = min(heads, lo + heads_per_block)
            logits = workspace[: (hi - lo) * rows * seen].view(hi - lo, rows, seen)
            torch.matmul(q[lo:hi, start:stop].view(hi - lo, rows, d), k[lo:hi, :seen].transpose(-1, -2), out=logits)
            logits[..., offset + start :].unflatten(1, (c, group)).masked_fill_(hidden[:c, :, :c], float("-inf"))
            probs, row_inverse = exp_rows_(logits, shifted, inverse[lo:hi, start:stop].view(hi - lo, rows, 1))
            mass[lo:hi, :, :seen].baddbmm_(row_inverse.transpose(-1, -2), probs)
            torch.matmul(probs, v[lo:hi, :seen], out=out[lo:hi, start:stop].view(hi - lo, rows, dv))
    return mass.squeeze(1)


def _in_worker(intra_op: int, threads: int, grad: bool, inference: bool, function, *args):
    """`function(*args)` in a worker thread with `intra_op` intra-op threads and the caller's grad and
    inference modes (both are per thread). torch.set_num_threads also sets the count that new
    threads start with, so `threads` (the caller's) is put back afterwards."""
    torch.set_num_threads(intra_op)
    try:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return function(*args)
    finally:
        torch.set_num_threads(threads)


# --- padded batches and model families (Gemma 2 soft-capping, sliding-window layers) ---


def _softcap_scores(query, keys, scaling, softcap):
    """[B,H_q,q,n] float32 logits tanh(s<q,k>/cap)·cap (Gemma 2), keys [B,H_kv,n,d] shared by GQA groups.

    Computed in the query's dtype, as Gemma 2's own attention does, so bfloat16 matches it."""
    group = query.shape[1] // keys.shape[1]
    logits = torch.matmul(query, keys.to(query.dtype).repeat_interleave(group, 1).transpose(-1, -2)) * scaling
    return (torch.tanh(logits / softcap) * softcap).float()


def _query_chunks(query, n_keys):
    """Query index ranges such that no chunk holds more than about 2^25 scores."""
    b, hq, nq, _ = query.shape
    chunk = max(1, (1 << 25) // max(1, b * hq * n_keys))
    return [(start, start + chunk) for start in range(0, nq, chunk)]


def softcapped_weighted_attention(query, summary, scaling, softcap, query_positions):
    """weighted_attention with soft-capped logits: log-weights and causality added after the cap. -> [B,H_q,q,d_v]."""
    group = query.shape[1] // summary.keys.shape[1]
    den = summary.denominator()

    def biased(q, qpos, keys, log_weights, positions):
        scores = _softcap_scores(q, keys, scaling, softcap) + log_weights.float().repeat_interleave(group, 1)[:, :, None]
        hidden = positions.repeat_interleave(group, 1)[:, :, None, :] > qpos[None, None, :, None]
        return scores.masked_fill(hidden, float("-inf"))

    outs = []
    for start, stop in _query_chunks(query, summary.num_slots + den.keys.shape[2]):
        q, qpos = query[:, :, start:stop], query_positions[start:stop]
        numerator = biased(q, qpos, summary.keys, summary.log_weights, summary.positions)
        log_den = torch.logsumexp(biased(q, qpos, den.keys, den.log_weights, den.positions), dim=-1, keepdim=True)
        probs = torch.exp(numerator - log_den).nan_to_num(0.0).to(query.dtype)
        outs.append(torch.matmul(probs, summary.values.to(query.dtype).repeat_interleave(group, 1)))
    return torch.cat(outs, dim=2)


def exact_attention_with_mask(module, query, key, value, attention_mask, scaling, softcap, **kwargs):
    """Exact attention over every key with the model's boolean mask (None: causal) -> ([B,q,H_q,d], None); SDPA unless
    soft-capped. A `dropout` probability goes to SDPA (`kvcompress_attention` refuses one with soft-capping)."""
    if softcap is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    n_q, n_k = query.shape[2], key.shape[2]
    if attention_mask is None:
        attention_mask = torch.ones(n_q, n_k, dtype=torch.bool, device=query.device).tril(n_k - n_q)[None, None]
    group = query.shape[1] // key.shape[1]
    outs = []
    for start, stop in _query_chunks(query, n_k):
        scores = _softcap_scores(query[:, :, start:stop], key, scaling, softcap)
        probs = scores.masked_fill(~attention_mask[:, :, start:stop], float("-inf")).softmax(-1).nan_to_num(0.0).to(query.dtype)
        outs.append(torch.matmul(probs, value.repeat_interleave(group, 1)))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, kvcompress_attention)
# SDPA's boolean masks (None where plain causal suffices). Over a compressed layer the columns are
# original positions (its get_mask_sizes), so the last row tells which tokens are padding.
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
