"""Model inspection: which models and layers kvcompress supports, their attention scales and rotary embedding,
switching a model to the kvcompress attention implementation, the per-model lock kvcompress's calls hold
(`model_lock`), and the recording attention captures and KVzip's scoring run under (`recording_attention`).

What the cache must know about a model, and nothing that generates: it sits below `kvcompress.cache`
(docs/layout.md, layer "model support"). The attention implementation it switches to is registered
by `kvcompress.integration` when that is imported (`kvc.CompressedCache` imports it)."""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref

import torch
from transformers import GenerationConfig
from transformers.cache_utils import get_layer_types_and_kwargs

ATTENTION_NAME = "kvcompress"  # the attention implementation a CompressedCache needs (kvcompress.integration.attention)


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")


def check_supported(model) -> list[tuple[str, int | None]]:
    """[(layer type, sliding window)] per layer: "full_attention" (compressed) or "sliding_attention" (window kept exact).

    Raises a clear error for a model kvcompress does not support. A sliding window at least as long
    as the model's positions never slides, so such a layer counts as full attention.
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ValueError(f"model must be a transformers model (e.g. kvc.load_model()'s first result), got {type(model).__name__}")
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"unsupported model type {model_type!r}: kvcompress supports decoder-only models using transformers' "
            f"AttentionInterface: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"unsupported model: layer types {unknown}; kvcompress handles full_attention and sliding_attention layers")
    longest = getattr(config, "max_position_embeddings", None)
    layers = []
    for kind, kw in zip(types, kwargs):
        window = kw.get("sliding_window")
        if kind == "sliding_attention" and longest is not None and window >= longest:
            kind, window = "full_attention", None
        layers.append((kind, window))
    return layers


def attention_modules(model) -> list:
    """The model's attention modules (those with a layer index and an attention scale), in module order."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]


def attention_scales(model) -> dict[int, float]:
    """{layer_idx: attention scale} of the model's attention modules."""
    return {m.layer_idx: m.scaling for m in attention_modules(model)}


# Each thread's {attention module: the hidden states its running forward received} (`keep_hidden_states`), until the
# 'kvcompress' attention function of the same forward takes them (`take_hidden_states`): per thread, so that forwards
# of one model in several threads each read their own; weakly keyed, so that a freed model leaves nothing behind.
_KEPT = threading.local()


def _kept_hidden_states() -> weakref.WeakKeyDictionary:
    """This thread's {attention module: hidden states} (`keep_hidden_states`)."""
    kept = getattr(_KEPT, "by_module", None)
    if kept is None:
        kept = _KEPT.by_module = weakref.WeakKeyDictionary()
    return kept


def take_hidden_states(module):
    """The hidden states `module`'s forward in this thread received (and forget them), or None."""
    return _kept_hidden_states().pop(module, None)


def _keep(module, args, kwargs=None) -> None:
    """The pre-hook of `keep_hidden_states`: only while the module runs the 'kvcompress' attention, which takes them (a
    plain forward of the same model keeps nothing). A hook removed while a forward runs (`release_hidden_states` from
    another cache's finalizer) may still be called by torch in that forward, without its kwargs: then it keeps the
    positional hidden states, or nothing."""
    config = getattr(module, "config", None)
    if config is not None and getattr(config, "_attn_implementation", ATTENTION_NAME) != ATTENTION_NAME:
        return
    hidden = (kwargs or {}).get("hidden_states", args[0] if args else None)
    if hidden is not None:
        _kept_hidden_states()[module] = hidden


def keep_hidden_states(model) -> list:
    """One forward pre-hook per attention module of `model` that keeps the hidden states the module receives (its
    `hidden_states` argument, [B, n, d_model] after the layer's input norm, a reference, no copy) in this thread's
    `_kept_hidden_states`, for a method that reads them (`Requirements.inputs` "hidden_states"); the 'kvcompress'
    attention function takes them (`take_hidden_states`) in the same forward. Returns the hooks' handles;
    `release_hidden_states` removes them."""
    return [m.register_forward_pre_hook(_keep, with_kwargs=True) for m in attention_modules(model)]


def release_hidden_states(handles: list) -> None:
    """Remove the hooks of `keep_hidden_states`. It leaves what they kept alone: it may run at any moment (a cache's
    finalizer, during another cache's forward), when a live hook's hidden states wait for their attention."""
    for handle in handles:
        handle.remove()


def find_rotary_embedding(model):
    """(rotary embedding module, extra forward kwargs for the full-attention layers' rotation, the rotation's
    `attention_scaling`: the factor transformers multiplies its cos and sin by, 1 for plain RoPE, above 1 for YaRN and
    LongRoPE). A model whose compressed layers include sliding layers promoted to full attention (`check_supported`: a
    window as long as the positions) with a RoPE of their own (Gemma 3's local RoPE) is refused: one inverse cannot
    serve both."""
    module = rotary_embedding(model)
    if module is None:
        raise ValueError("the model has no rotary embedding module: cannot recover pre-RoPE keys")
    if "layer_type" not in inspect.signature(module.forward).parameters:
        return module, {}, float(getattr(module, "attention_scaling", 1.0))
    declared = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))[0]  # Gemma 3: local and global RoPE
    promoted = [i for i, ((kind, _), declared_kind) in enumerate(zip(check_supported(model), declared))
                if kind == "full_attention" and declared_kind == "sliding_attention"]
    if promoted:
        raise ValueError(f"layers {promoted} slide over a window as long as the model's positions, so kvcompress compresses "
                         "them as full attention, but they rotate keys with a RoPE of their own: their pre-RoPE keys "
                         "cannot be recovered with the full-attention layers' inverse; use a method that reads no "
                         "pre-RoPE keys")
    return module, {"layer_type": "full_attention"}, float(getattr(module, "full_attention_attention_scaling", 1.0))


def rotary_embedding(model):
    """The model's rotary embedding module (the first whose class name ends in "RotaryEmbedding"), or None."""
    return next((module for module in model.modules() if type(module).__name__.endswith("RotaryEmbedding")), None)


def length_dependent_rope(model) -> tuple[str, int] | None:
    """(RoPE type, original context length) when the full-attention layers' rotation picks its frequencies from the
    length each forward reaches, else None: LongRoPE rotates a forward that ends within `original_max_position_embeddings`
    with its short factors and one beyond with its long ones; dynamic NTK rescales beyond the original length. Keys
    fed in blocks are then rotated otherwise than by one forward over the same tokens, and keys rotated by an earlier,
    shorter forward cannot be un-rotated with the frequencies of a later one."""
    module = rotary_embedding(model)
    rope_type = "default" if module is None else getattr(module, "rope_type", "default")
    rope_type = rope_type.get("full_attention", "default") if isinstance(rope_type, dict) else rope_type
    if rope_type == "longrope":  # the length transformers' LongRoPE switches factors at
        params = module.config.rope_parameters
        params = params.get("full_attention", params) if "rope_type" not in params else params
        return rope_type, int(params.get("original_max_position_embeddings") or module.config.original_max_position_embeddings)
    if "dynamic" in rope_type:  # rescaled beyond the length it was built for
        return rope_type, int(module.original_max_seq_len)
    return None


def cache_dropping_length(model) -> int | None:
    """The sequence length whose first crossing makes transformers' `model.generate` drop the cache it was given and
    recompute the sequence in a fresh one, else None: Phi-3 (`Phi3ForCausalLM.prepare_inputs_for_generation`) does so
    when the sequence first passes `original_max_position_embeddings` below `max_position_embeddings`, so that every key
    is rotated with its long-context factors. A compressed cache cannot be recomputed: the rest of the answer would come
    from an uncompressed cache."""
    config = model.config
    switch, limit = getattr(config, "original_max_position_embeddings", None), getattr(config, "max_position_embeddings", None)
    if getattr(config, "model_type", None) != "phi3" or switch is None or (limit is not None and limit <= switch):
        return None
    return int(switch)


_MODEL_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MODEL_LOCKS_GUARD = threading.Lock()


def model_lock(model) -> threading.RLock:
    """The lock kvcompress's calls hold while they run `model` (`integration.generation`): a call switches the model's
    attention implementation and generation config for its duration, so calls on one model from several threads run
    one at a time. Re-entrant (a call inside a call of the same thread)."""
    with _MODEL_LOCKS_GUARD:
        lock = _MODEL_LOCKS.get(model)
        if lock is None:
            lock = _MODEL_LOCKS[model] = threading.RLock()
        return lock


# How many times each model was switched to the 'kvcompress' attention for its other uses too (`select_compressed_attention`
# with keep=True: a cache built by name, loaded, or compressed for later questions).
_KEPT_SWITCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def select_compressed_attention(model, keep: bool = False) -> None:
    """Switch the model to the 'kvcompress' attention implementation (registered by `kvcompress.integration`), under the
    model's lock (`model_lock`: it waits for another thread's kvcompress call on the model to end). keep: for the
    model's other uses too, so that a `use_compressed_attention` around it (a call of this thread) leaves it switched
    when it ends."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ATTENTION_NAME not in ALL_ATTENTION_FUNCTIONS.valid_keys():
        raise ValueError(f"the {ATTENTION_NAME!r} attention is registered by kvcompress.integration: import it first (kvc.CompressedCache does)")
    with model_lock(model):
        if model.config._attn_implementation != ATTENTION_NAME:
            model.set_attn_implementation(ATTENTION_NAME)
        if keep:
            with _MODEL_LOCKS_GUARD:
                _KEPT_SWITCHES[model] = _KEPT_SWITCHES.get(model, 0) + 1


def autocast_off(device: torch.device):
    """A context with torch.autocast off on `device`'s type (a compressed layer stores, attends and compresses in its
    stored dtype), or one that does nothing where autocast is not on (a check, not a context switch, per call)."""
    try:
        enabled = torch.is_autocast_enabled(device.type)
    except RuntimeError:  # a device type autocast does not know (meta): nothing to turn off
        enabled = False
    return torch.autocast(device.type, enabled=False) if enabled else contextlib.nullcontext()


def common_dtype(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values in one dtype that holds both (`torch.promote_types`: the wider of the two, float32 for bfloat16
    beside float16): under torch.autocast a model's rotary embedding returns keys in the model's dtype beside values in
    the autocast dtype, and a summary holds one."""
    if keys.dtype == values.dtype:
        return keys, values
    common = torch.promote_types(keys.dtype, values.dtype)
    return keys.to(common), values.to(common)


# model.generate's own arguments beside its GenerationConfig's fields, and a transformers pipeline's way of passing them
_GENERATE_ARGUMENTS = ("generation_config", "logits_processor", "stopping_criteria", "streamer", "assistant_model", "negative_prompt_ids",
                       "generate_kwargs")


def decoding_settings(names, given) -> tuple[list[str], str]:
    """Which of `names` are `model.generate`'s decoding settings given as settings (keys of `given`; not a name inside
    `method_params`, which the user meant for the method): a `GenerationConfig` field such as do_sample, temperature or
    num_beams, or one of generate's own arguments such as a streamer, in their order; -> (those names, what a message
    says of the others: "" when there are none)."""
    fields = GenerationConfig().to_dict()  # its settings (not its methods' names)
    decoding = [name for name in names if name in given and (name in _GENERATE_ARGUMENTS or name in fields)]
    rest = [name for name in names if name not in decoding]
    return decoding, f"; {', '.join(rest)} {'is' if len(rest) == 1 else 'are'} not an option or a parameter of the method either" if rest else ""


def has_padding(real: torch.Tensor | None) -> bool:
    """Whether a block's real-token flags [B, n] (None: no mask) mark any padding (one device sync)."""
    return real is not None and not bool(real.all())


class RotaryInverse:
    """Un-rotates a model's post-RoPE keys: (keys [B,H,n,d], positions [n] or [B,H,n]) -> pre-RoPE keys.

    RoPE maps halves (x1, x2) to (x1·cos − x2·sin, x2·cos + x1·sin); the inverse is written half by
    half into one output, the same products and sums as the forward formula with −sin, with two
    half-size temporaries instead of five full-size ones. Partial rotary (Phi-3) rotates a prefix
    of the channels and leaves the rest as they are. The angles of the last call are kept and
    reused while the positions, batch shape and dtype repeat (every layer of one forward).
    """

    def __init__(self, model):
        self.rotary, self.extra, scaling = find_rotary_embedding(model)
        # transformers scales cos and sin by the rotation's attention_scaling s (YaRN, LongRoPE): the inverse of s·R is
        # R⁻¹/s, which is the formula below with cos and sin divided by s²
        self.unscale = 1.0 / scaling**2
        self._last_call: tuple | None = None  # (keys' [B,H,n] and dtype, positions' shape and device) of the last call
        self._last_positions: torch.Tensor | None = None
        self._last_angles: tuple[torch.Tensor, torch.Tensor] | None = None

    def _angles(self, keys: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) broadcastable to keys [B,H,n,·] at positions [n] or [B,H,n], in the keys' dtype."""
        b, h, n, _ = keys.shape
        call = (keys.shape[:3], keys.dtype, positions.shape, positions.device)
        if call == self._last_call and torch.equal(self._last_positions, positions):
            return self._last_angles
        if positions.ndim == 1:
            cos, sin = self.rotary(keys, positions[None].expand(b, -1), **self.extra)
            cos, sin = cos[:, None].to(keys.dtype), sin[:, None].to(keys.dtype)
        else:
            cos, sin = self.rotary(keys, positions.reshape(b * h, n), **self.extra)
            cos, sin = cos.view(b, h, n, -1).to(keys.dtype), sin.view(b, h, n, -1).to(keys.dtype)
        if self.unscale != 1.0:
            cos, sin = cos * self.unscale, sin * self.unscale
        self._last_call, self._last_positions, self._last_angles = call, positions.clone(), (cos, sin)
        return cos, sin

    def __call__(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self._angles(keys, positions)
        width = cos.shape[-1]
        half = width // 2
        first, second = keys[..., :half], keys[..., half:width]
        out = torch.empty_like(keys)
        torch.mul(first, cos[..., :half], out=out[..., :half]).add_(second * sin[..., :half])
        torch.mul(second, cos[..., half:], out=out[..., half:width]).sub_(first * sin[..., half:])
        out[..., width:] = keys[..., width:]
        return out


class use_compressed_attention:
    """Context manager: run `model` with the 'kvcompress' attention implementation, restoring the old one after, unless
    the model was switched for its other uses meanwhile (`select_compressed_attention(keep=True)`). It does not hold
    the model's lock (`model_lock`): a caller that runs kvcompress forwards beside other threads' calls on the model
    holds it around the block, as `kvc.generate` and `kvc.calibrate` do."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.previous = self.model.config._attn_implementation
        self.kept_switches = _KEPT_SWITCHES.get(self.model, 0)
        select_compressed_attention(self.model)
        return self.model

    def __exit__(self, *exc):
        _switch_back(self.model, self.previous, self.kept_switches)
        return False


def _switch_back(model, previous: str, kept_switches: int) -> None:
    """Give the model back the attention implementation `previous` it had when a call switched it, unless a cache built
    by name switched it to 'kvcompress' for its other uses since (`_KEPT_SWITCHES` moved from `kept_switches`): then
    it keeps that one."""
    wanted = previous if _KEPT_SWITCHES.get(model, 0) == kept_switches else ATTENTION_NAME
    if model.config._attn_implementation != wanted:
        model.set_attn_implementation(wanted)


RECORDING_ATTENTION_NAME = "kvcompress_recording"  # the implementation `recording_attention` switches a model to
_RECORDING = threading.local()  # .recordings: the calling thread's [(its model's module ids, attention function)], innermost last


def _recording_dispatch(module, query, key, value, attention_mask, **kwargs):
    """The implementation registered as RECORDING_ATTENTION_NAME: the recording attention that the thread running the
    forward switched this layer's model to (`recording_attention`), so that two models recorded in two threads record
    each its own."""
    for modules, attention in reversed(getattr(_RECORDING, "recordings", ())):
        if id(module) in modules:
            return attention(module, query, key, value, attention_mask, **kwargs)
    raise RuntimeError("this model runs kvcompress's recording attention for a call in another thread (KVzip's scores, a "
                       "capture of queries, keys and values); a forward of it from this thread meanwhile would be recorded "
                       "there: give this thread a model of its own")


@contextlib.contextmanager
def recording_attention(model, attention):
    """Context manager: run `model` with `attention(module, query, key, value, attention_mask, **kwargs)` (a transformers
    attention function, under SDPA's masks, sliding windows included) as every layer's attention, for forwards this
    thread runs, holding the model's lock (`model_lock`); the old implementation is restored after (or 'kvcompress', if
    a cache built by name in the block switched the model for its other uses). What is registered with transformers
    (one process-wide name, RECORDING_ATTENTION_NAME) dispatches to the function this thread gave for the layer's
    model, so recordings of two models in two threads never see each other's layers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(RECORDING_ATTENTION_NAME, _recording_dispatch)
    ALL_MASK_ATTENTION_FUNCTIONS.register(RECORDING_ATTENTION_NAME, sdpa_mask)
    recordings = _RECORDING.__dict__.setdefault("recordings", [])
    with model_lock(model):
        previous, kept_switches = model.config._attn_implementation, _KEPT_SWITCHES.get(model, 0)
        recordings.append(({id(m) for m in model.modules()}, attention))
        try:
            model.set_attn_implementation(RECORDING_ATTENTION_NAME)
            yield model
        finally:
            recordings.pop()
            _switch_back(model, previous, kept_switches)
