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


@pytest.mark.parametrize("first, second", [("capture", "generate"), ("generate", "capture"), ("capture", "capture"),
                                           ("calibrate", "generate"), ("generate", "calibrate")])
def test_a_capture_a_calibration_and_a_generation_on_one_model_wait_for_each_other(tiny_checkpoint, first, second):
    """On one model, a capture of queries and keys (what a recorded prefill runs), `kvc.calibrate` (a capture, then
    forwards through compressed caches) and a generation hold the model's lock: started in another thread while the
    first is inside its forward, the second waits for it (the model keeps the first's attention implementation
    meanwhile), then both give what they give alone. (A calibration ran beside a generation: each switched the
    model's attention under the other's forwards: wrong answers, refused masks, missing layers.)"""
    import kvcompress as kvc

    model, tokenizer = kvc.load_model(tiny_checkpoint)
    model.set_attn_implementation("sdpa")
    prompts = [_prompt(n=120, seed=1), _prompt(n=100, seed=3)]
    samples = [("The river runs past the old mill. " * 6, "Where does the river run?", "Past the mill.")]

    def run(kind, i):
        ctx, question = prompts[i]
        if kind == "capture":
            return _captured(model, torch.cat([ctx, question], 1))
        if kind == "calibrate":
            triples = []
            kvc.calibrate(model, tokenizer, samples, "snapkv", retentions=(0.5, 1.0), progress=triples.append)
            return [t["nll_compressed"] for t in triples]
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


def test_a_thread_a_compressed_attention_block_waits_on_may_build_a_cache_by_name():
    """`use_compressed_attention` does not hold the model's lock, so code in the block that waits on another thread
    building a cache by name (which takes it, to switch the model) finishes; holding it there deadlocked."""
    from concurrent.futures import ThreadPoolExecutor

    import kvcompress as kvc
    from kvcompress.model_support import use_compressed_attention

    model = tiny("llama")
    with use_compressed_attention(model), ThreadPoolExecutor(1) as pool:
        built = pool.submit(kvc.CompressedCache, model, "knorm", budget=16)
        cache = built.result(timeout=60)
    assert model.config._attn_implementation == "kvcompress" and cache.options.method == "knorm"


def test_a_forward_of_another_model_inside_a_recording_is_not_recorded():
    """The recording attention runs what the thread gave for the forward's own model: a plain forward of model B inside
    a capture of model A (one thread) is refused by name rather than recorded as A's; A's capture is whole."""
    from kvcompress.integration.attention import exact_attention_with_mask
    from kvcompress.model_support import RECORDING_ATTENTION_NAME, recording_attention

    a, b = tiny("llama"), tiny("llama", seed=1)
    ids = torch.cat(_prompt(n=40), 1)
    recorded = []

    def record(module, query, key, value, attention_mask, **kwargs):
        recorded.append(module.layer_idx)
        return exact_attention_with_mask(module, query, key, value, attention_mask, kwargs.pop("scaling", None), kwargs.pop("softcap", None), **kwargs)

    with recording_attention(a, record), torch.no_grad():
        b.set_attn_implementation(RECORDING_ATTENTION_NAME)  # as another thread's recording of B switches it
        with pytest.raises(RuntimeError, match="recording attention .*give this thread a model of its own"):
            b(ids)
        a(ids)
    assert recorded == [0, 1]


def test_models_loaded_in_several_threads_at_once_are_each_the_checkpoint(tmp_path):
    """`kvc.load_model` from four threads at once: transformers' loading is not thread-safe, and such loads failed
    ("Cannot copy out of meta tensor") or came back with tied weights untied; they now take turns, and each thread gets
    the checkpoint's weights, tied as saved."""
    from test_hf import _word_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvcompress as kvc

    tokenizer = _word_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reference = kvc.load_model(tmp_path)[0].state_dict()
    for _ in range(3):
        start, loaded = threading.Barrier(4), {}

        def load(i):
            start.wait()
            try:
                loaded[i] = kvc.load_model(tmp_path)[0]
            except Exception as error:  # noqa: BLE001 - what the thread met is the finding
                loaded[i] = error
        threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for model in loaded.values():
            assert isinstance(model, torch.nn.Module), model
            assert model.lm_head.weight is model.model.embed_tokens.weight
            assert all(torch.equal(tensor, reference[name]) for name, tensor in model.state_dict().items())
