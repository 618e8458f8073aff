"""docs/extending.md, "Adding a method", run as printed: its method module registers, and its session compresses and
streams with it, printing what the page shows. The snippets are read from the page (`test_readme.snippets`), so
editing the example changes what is run."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvcompress.methods import registry
from test_readme import printed, run_python, shown, snippets

PAGE = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text(encoding="utf-8")


def method_snippets() -> list[str]:
    """The Python snippets of the page's "Adding a method" section: the method's module, then the session using it."""
    section = PAGE[PAGE.index("## Adding a method"):PAGE.index("## Adding a task")]
    return [body for _, body in snippets("python", section)]


@pytest.fixture
def method_module(monkeypatch):
    """The module the page creates, `kvcompress.methods.mymethod`, empty; it and the registry (on a copy) are dropped
    after the test, so the example's method stays out of the other tests."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    module = ModuleType("kvcompress.methods.mymethod")
    module.__package__ = "kvcompress.methods"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_the_method_of_extending_md_registers_and_runs_one_shot_and_streamed(method_module):
    code, session = method_snippets()
    run_python(code, method_module.__dict__)
    assert registry.get_method_class("mymethod") is method_module.MyMethod
    out = run_python(session, {})
    assert printed(out) == shown(session.split("\n"))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        registry.build_method("mymethod", temperature=0.0)
    for bad in ("2", True, float("inf"), None):  # were a TypeError, or taken (inf made every score 0)
        with pytest.raises(ValueError, match=r"temperature must be a finite number \(the divisor of the key norms, > 0\), got"):
            registry.build_method("mymethod", temperature=bad)


def test_a_method_parameter_named_like_a_decoding_setting_is_the_method_s(method_module):
    """The page's method takes `temperature`, also a field of transformers' GenerationConfig: kvc.generate and the pipeline
    hand it to the method, where a method without it refuses it as model.generate's decoding setting."""
    from transformers import pipeline

    import kvcompress as kvc
    from kvcompress.integration import PIPELINE_TASK
    from test_hf import _word_tokenizer
    from test_integration import _words, tiny

    run_python(method_snippets()[0], method_module.__dict__)
    model, tokenizer = tiny("llama"), _word_tokenizer()
    context = _words(200)
    settings = dict(compression_ratio=0.5, max_new_tokens=3, progress=False, stop_at_eos=False)
    answers = [kvc.generate(model, tokenizer, context, "w1", method="mymethod", temperature=t, **settings) for t in (1.0, 2.0)]
    assert answers[0].token_ids == answers[1].token_ids and answers[0].method == "mymethod"  # a divisor of every score
    pipe = pipeline(PIPELINE_TASK, model=model, tokenizer=tokenizer)
    assert pipe(context, question="w1", method="mymethod", temperature=2.0, **settings)["result"].token_ids == answers[1].token_ids
    with pytest.raises(ValueError, match="temperature must be > 0"):
        kvc.generate(model, tokenizer, context, "w1", method="mymethod", temperature=0.0, **settings)
    with pytest.raises(ValueError, match="temperature is one of model.generate's decoding settings"):
        kvc.generate(model, tokenizer, context, "w1", method="snapkv", temperature=2.0, **settings)
