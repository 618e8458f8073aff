"""Input checks shared by the public entry points: errors name the parameter, what was received and what is accepted.

Shape, dtype and device checks read metadata only. The one data-dependent check, `check_finite`,
can run without a host synchronisation on an accelerator (sync=False), for the decode hot path.
"""

from __future__ import annotations

import importlib
import math
import numbers
from types import ModuleType

import torch

from .names import MAX_SEED


def describe(t) -> str:
    """'tensor [1, 2, 40, 8] float32 on cpu', or the type of a non-tensor."""
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    return f"tensor {list(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"


def check_tensor(name: str, t, layout: str, ndim: int) -> None:
    """t must be a floating-point torch.Tensor with `ndim` dimensions (described by `layout`, e.g. "[B, H_kv, n, d]")."""
    if not isinstance(t, torch.Tensor) or t.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D tensor {layout}, got {describe(t)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor (float32, float16, bfloat16, ...), got {describe(t)}")
    if t.is_meta:
        raise ValueError(f"{name} is on the meta device, which holds shapes but no values: compress tensors on the CPU or a "
                         f"GPU, got {describe(t)}")


def check_finite(name: str, t: torch.Tensor, sync: bool = True) -> None:
    """NaN or infinite entries in t are an error naming `name`.

    On the CPU (or with sync=True) a ValueError at once. With sync=False on another device, an
    assertion queued on that device instead (no host synchronisation): a failure surfaces at a
    later synchronisation and ends the CUDA context, as a device-side assert does.
    """
    message = f"{name} contain NaN or infinite entries"
    if sync or t.device.type == "cpu":
        # One reduction instead of an entry-wise mask (far cheaper on the CPU): a NaN or inf entry
        # makes the sum non-finite; a non-finite sum of finite entries (overflow) is ruled out entry-wise.
        if not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
            raise ValueError(message)
    else:
        torch._assert_async(torch.isfinite(t).all(), message)


def check_same_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} must be on the same device as {ref_name} ({ref.device}), got {describe(t)}")


def check_queries(queries, keys: torch.Tensor, keys_name: str = "keys") -> None:
    """queries [B, H_q, n_q, d] against keys [B, H_kv, n, d]: same batch (no broadcasting), same head dim, H_q a multiple of H_kv, same device."""
    check_tensor("queries", queries, "[B, H_q, n_q, d]", 4)
    if queries.shape[2] == 0:
        raise ValueError(f"queries hold no tokens (n_q = 0), got {describe(queries)}; pass at least one query or None")
    b, hkv, _, d = keys.shape
    if queries.shape[0] != b:
        raise ValueError(f"queries must have the batch size of {keys_name} ({b}); got batch {queries.shape[0]} ({describe(queries)}); no broadcasting")
    if queries.shape[-1] != d:
        raise ValueError(f"queries must have the head dim of {keys_name} (d = {d}), got d = {queries.shape[-1]} ({describe(queries)})")
    if queries.shape[1] % hkv != 0:
        raise ValueError(f"query heads ({queries.shape[1]}) must be a multiple of KV heads ({hkv}) of {keys_name}")
    check_same_device("queries", queries, keys_name, keys)


def as_count(name: str, value, minimum: int, optional: bool = False) -> int | None:
    """An integer >= minimum (Python or NumPy integers, 0-d integer tensors) as a Python int; bool and floats are rejected.
    optional: None is accepted too (and returned)."""
    if optional and value is None:
        return None
    accepted = f"{'None or ' if optional else ''}an integer >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.Tensor)):
        raise ValueError(f"{name} must be {accepted}, got {value!r}")
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.is_floating_point() or value.dtype == torch.bool:
            raise ValueError(f"{name} must be {accepted}, got {value!r}")
        value = value.item()
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be {accepted}, got {value}")
    return value


def check_bool(name: str, value) -> None:
    """ValueError naming `name` unless `value` is True or False (a truthy string or number would be read as True)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


TOKEN_ID_DTYPES = (torch.int64, torch.int32)  # what a model's input embedding takes


def check_token_ids(name: str, ids, layout: str, vocab: int | None = None, rows: int | None = None, least: int = 1,
                    prefix: str = "") -> None:
    """Refuse anything but a token id tensor (int64 or int32) of `layout` (e.g. "[1, m] with m >= 1"): 2-D, `rows` rows
    (any when None), at least `least` tokens; given `vocab`, also ids outside [0, vocab). The range is read once (a
    device synchronisation): check once per call, not per token. `prefix` starts the messages."""
    if (not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[1] < least or (rows is not None and ids.shape[0] != rows)
            or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
        raise ValueError(f"{prefix}{name} must be an integer tensor {layout}, got {describe(ids)}")
    if ids.dtype not in TOKEN_ID_DTYPES:
        raise ValueError(f"{prefix}{name} must hold its token ids as int64 or int32 (what a model's embedding takes), got {describe(ids)}")
    if vocab is not None and ids.numel():
        low, high = torch.stack(torch.aminmax(ids)).tolist()
        if low < 0 or high >= vocab:
            raise ValueError(f"{prefix}{name} must hold token ids from 0 to {vocab - 1} (the model's vocabulary of {vocab}), "
                             f"got ids from {low} to {high}")


def check_distinct(name: str, values) -> None:
    """A ValueError naming `name` when `values` (a sweep's or benchmark's list of points) holds one twice: a repeat would
    run and report one point twice."""
    seen = [getattr(v, "name", v) for v in values]  # objects by name (a benchmark's shapes)
    repeated = sorted({repr(v) for v in seen if seen.count(v) > 1})
    if repeated:
        raise ValueError(f"{name} must not repeat a value, got {', '.join(repeated)} more than once in {seen}")


def as_seed(value) -> int:
    """A seed: an integer from 0 to `names.MAX_SEED` (the seeds derived from it stay within a generator's 64 bits)."""
    seed = as_count("seed", value, 0)
    if seed > MAX_SEED:
        raise ValueError(f"seed must be at most 2**63 - 1, got {seed}")
    return seed


def _real_of(value):
    """A 0-d floating or integer tensor's Python number (as `as_count` takes 0-d integer tensors); anything else as given."""
    if isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype != torch.bool and not value.is_complex():
        return value.item()
    return value


def as_fraction(name: str, value, what: str) -> float:
    """A real number in [0, 1) (Python or NumPy, or a 0-d tensor) as a Python float; `what` says what it means."""
    value = _real_of(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1) ({what}), got {value!r}")
    return float(value)


def as_real(name: str, value, what: str, minimum: float | None = None) -> float:
    """A finite real number (Python or NumPy, or a 0-d tensor; not a bool), at least `minimum` if given, as a Python
    float; `what` says what it means."""
    value = _real_of(value)
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or (minimum is not None and value < minimum)):
        bound = f" >= {minimum:g}" if minimum is not None else ""
        raise ValueError(f"{name} must be a finite number{bound} ({what}), got {value!r}")
    return float(value)


def check_layer(layer) -> tuple[int | None, int | None]:
    """(layer_idx, num_layers) from `layer`: None, or a pair with 0 <= layer_idx < num_layers."""
    if layer is None:
        return None, None
    if not isinstance(layer, tuple) or len(layer) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in layer) or not 0 <= layer[0] < layer[1]:
        raise ValueError(f"layer must be (layer_idx, num_layers) with 0 <= layer_idx < num_layers, or None, got {layer!r}")
    return layer


def check_kv(keys, values, queries=None, pre_rope_keys=None, sync: bool = True, hidden_states=None) -> None:
    """Shape, dtype, device and finiteness checks of one layer's inputs, with errors that name the argument.

    sync=False: the finiteness check forces no host synchronisation off the CPU (see `check_finite`).
    """
    check_tensor("keys", keys, "[B, H_kv, n, d]", 4)
    check_tensor("values", values, "[B, H_kv, n, d_v]", 4)
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"keys and values must agree on [B, H_kv, n]; got keys {describe(keys)} and values {describe(values)}")
    check_same_device("values", values, "keys", keys)
    if values.dtype != keys.dtype:
        raise ValueError(f"values must have the keys' dtype {keys.dtype}, got {describe(values)}")
    if keys.shape[0] == 0 or keys.shape[1] == 0:
        raise ValueError(f"keys must hold at least one batch row and one KV head, got {describe(keys)}")
    if keys.shape[2] == 0:
        raise ValueError(f"empty context: keys have no tokens (n = 0), got {describe(keys)}")
    if queries is not None:
        check_queries(queries, keys)
    if pre_rope_keys is not None:
        check_tensor("pre_rope_keys", pre_rope_keys, "[B, H_kv, n, d]", 4)
        if pre_rope_keys.shape != keys.shape:
            raise ValueError(f"pre_rope_keys must have the keys' shape {list(keys.shape)}, got {describe(pre_rope_keys)}")
        check_same_device("pre_rope_keys", pre_rope_keys, "keys", keys)
    if hidden_states is not None:
        check_tensor("hidden_states", hidden_states, "[B, H_kv, n, d_model]", 4)
        if hidden_states.shape[:3] != keys.shape[:3]:
            raise ValueError(f"hidden_states must agree with the keys on [B, H_kv, n] = {list(keys.shape[:3])}, got {describe(hidden_states)}")
        check_same_device("hidden_states", hidden_states, "keys", keys)
    for name, t in (("keys", keys), ("values", values), ("queries", queries), ("pre_rope_keys", pre_rope_keys), ("hidden_states", hidden_states)):
        if t is not None:
            check_finite(name, t, sync)


def check_positions(positions, keys: torch.Tensor, ordered: bool = True, nonnegative: bool | None = None) -> None:
    """positions: integer tensor [n] or [B, H_kv, n] matching keys [B, H_kv, n, d]; `ordered`: also strictly increasing along
    the tokens; `nonnegative` (default: `ordered`): also >= 0. Each value check reads the tensor (a device sync)."""
    b, h, n, _ = keys.shape
    if (not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.dtype == torch.bool
            or tuple(positions.shape) not in ((n,), (b, h, n))):
        raise ValueError(f"positions must be an integer tensor [n] = [{n}] or [B, H_kv, n] = [{b}, {h}, {n}], got {describe(positions)}")
    if ordered and n > 1 and not bool((positions.diff(dim=-1) > 0).all()):
        raise ValueError("positions must be strictly increasing along the tokens (the original index of each token, in order)")
    if (ordered if nonnegative is None else nonnegative) and n and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0 (the original index of each token; -1 marks an empty slot), got {int(positions.min())}")


def check_scale(scale) -> float | None:
    """The attention scale: None (1/sqrt(d)) or a finite number > 0, as a Python float."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale (the attention scale s) must be a finite number > 0 or None for 1/sqrt(d), got {scale!r}")
    return float(scale)


class MissingPackage(ImportError):
    """An optional package a feature needs is not installed; the message names the feature, the package and how to install it."""


def require_package(module: str, extra: str, feature: str) -> ModuleType:
    """The module `module`, or `MissingPackage` naming `feature` and `pip install kvcompress[<extra>]`."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingPackage(f"{feature} needs the `{module}` package, which is not installed: pip install kvcompress[{extra}]") from err
