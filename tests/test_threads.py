"""kvcompress calls from several threads: on one model they run one at a time (`model_support.model_lock`), and the
recording attention (captures, KVzip's scoring forwards) records, in each thread, that thread's own model.

Each test makes the interleaving it checks happen: a hook in one call's forward (before its second layer) starts the
other call in another thread, so what would race is not left to chance.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvcompress.integration import generate_ids
from kvcompress.integration.capture import capture_qkv
from kvcompress.model_support import model_lock

from test_integration import _prompt, tiny


def _captured(model, ids):
    return {layer: tuple(t.clone() for t in tensors) for layer, tensors in capture_qkv(model, ids).items()}


def _same_capture(a, b) -> bool:
    return a.keys() == b.keys() and all(all(torch.equal(x, y) for x, y in zip(a[k], b[k])) for k in a)


def _during_second_layer(model, work):
    """A forward pre-hook on the model's second decoder layer that runs `work()` on its first call; -> its handle."""
    done = []

    def hook(module, args):
        if not done:
            done.append(True)
            work()

    return model.model.layers[1].register_forward_pre_hook(hook)


def _in_a_thread(call, results: dict, key):
    def run():
        try:
            results[key] = call()
        except Exception as err:  # re-raised by the test
            results[key] = err

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("call", ["capture", "kvzip"])
def test_two_models_recorded_in_two_threads_each_record_their_own(call):
    """A capture (or KVzip's scoring forwards) of model B runs whole in another thread while one of model A is inside
    its forward: both give what they give alone (the recording attention transformers calls is one registered name:
    it must run the recording of the thread whose forward calls it, not the last one registered)."""
    models = {"a": tiny("llama"), "b": tiny("qwen3", seed=1)}
    prompts = {"a": _prompt(n=120, seed=1), "b": _prompt(n=90, seed=2)}

    def run(name):
        model, (ctx, question) = models[name], prompts[name]
        if call == "capture":
            return _captured(model, torch.cat([ctx, question], 1))
        return generate_ids(model, ctx, question, method="kvzip", budget=24, max_new_tokens=6, stop_at_eos=False).token_ids

    alone = {name: run(name) for name in models}
    results: dict = {}
    handle = _during_second_layer(models["a"], lambda: _in_a_thread(lambda: run("b"), results, "b").join())
    try:
        results["a"] = run("a")
    finally:
        handle.remove()
    for name in models:
        if isinstance(results[name], Exception):
            raise results[name]
        same = _same_capture(results[name], alone[name]) if call == "capture" else results[name] == alone[name]
        assert same, (name, call)


@pytest.mark.parametrize("first, second", [("capture", "generate"), ("generate", "capture"), ("capture", "capture")])
def test_a_capture_and_a_generation_on_one_model_wait_for_each_other(first, second):
    """On one model, a capture of queries and keys (what `kvc.calibrate` and a recorded prefill run) and a generation
    hold the model's lock: started in another thread while the first is inside its forward, the second waits for it
    (the model keeps the first's attention implementation meanwhile), then both give what they give alone."""
    model = tiny("llama")
    model.set_attn_implementation("sdpa")
    prompts = [_prompt(n=120, seed=1), _prompt(n=100, seed=3)]

    def run(kind, i):
        ctx, question = prompts[i]
        if kind == "capture":
            return _captured(model, torch.cat([ctx, question], 1))
        return generate_ids(model, ctx, question, method="snapkv", budget=24, max_new_tokens=6, stop_at_eos=False).token_ids

    alone = [run(first, 0), run(second, 1)]
    results: dict = {}
    seen = {}

    def start_the_second():
        seen["implementation"] = model.config._attn_implementation
        thread = _in_a_thread(lambda: run(second, 1), results, 1)
        thread.join(timeout=0.5)
        seen["waiting"] = thread.is_alive()
        seen["implementation after"] = model.config._attn_implementation
        seen["thread"] = thread

    handle = _during_second_layer(model, start_the_second)
    try:
        results[0] = run(first, 0)
    finally:
        handle.remove()
    seen["thread"].join()
    for i in (0, 1):
        if isinstance(results[i], Exception):
            raise results[i]
    assert seen["waiting"] and seen["implementation after"] == seen["implementation"], seen
    for i, kind in enumerate((first, second)):
        assert _same_capture(results[i], alone[i]) if kind == "capture" else results[i] == alone[i], (i, kind)
    assert model.config._attn_implementation == "sdpa"
    assert model_lock(model).acquire(blocking=False)  # nothing left holding it
    model_lock(model).release()
