import os
from dataclasses import replace

import pytest
import torch

# Tests run on small tensors; extra threads only contend on the shared 2-core machines: one thread per process when
# pytest-xdist runs one process per core (`make test`), two otherwise.
torch.set_num_threads(int(os.environ.get("KVCOMPRESS_TEST_THREADS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2")))


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` skip where torch sees no CUDA device (the one place that decides it)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer) of the real default model, loaded once per test session (e2e tests only)."""
    import kvcompress as kvc

    return kvc.load_model()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random Llama (2 layers) with a byte-level tokenizer, saved as a local checkpoint directory
    (what `load_model(path)`, shard processes and Ray workers load)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(alphabet), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    path = tmp_path_factory.mktemp("tiny_checkpoint")
    LlamaForCausalLM(config).save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tk).save_pretrained(path)
    return path


@pytest.fixture
def tiny_default_scorer(monkeypatch, tmp_path):
    """The default method (AdaKV over KVzap) on the tiny random models (2 layers, 2 KV heads of hidden width 64): the
    package's scorer for the default model (`kvzap.SHIPPED["default"]`) is replaced, for this test, by a seeded random
    linear surrogate of the tiny models' shapes, written as a scorer file. Returns its path."""
    from kvcompress.methods import kvzap

    g = torch.Generator().manual_seed(0)
    surrogate = kvzap.Surrogate("linear", (0, 1), torch.randn(2, 2, 64, 1, generator=g) / 8, torch.zeros(2, 2, 1), model="tiny")
    hidden = {layer: torch.randn(256, 64, generator=g) for layer in (0, 1)}
    surrogate = replace(surrogate, score_quantiles=kvzap.score_quantiles(surrogate, hidden))
    path = tmp_path / "tiny-kvzap.safetensors"
    surrogate.save(path)
    monkeypatch.setattr(kvzap, "shipped_path", lambda name: path)
    return path
