"""The README's first example, run as printed on the default model."""

import pytest

import kvcompress as kvc


@pytest.mark.e2e
@pytest.mark.smoke
def test_the_first_readme_example_prints_the_needle(default_model):
    model, tokenizer = default_model
    context = "The magic number is 4217. " + "Grass is green. " * 30
    question = "What is the magic number?"
    answers = {}
    for method in ("keydiff", "snapkv"):
        cache = kvc.CompressedCache(model, method, compression_ratio=0.5)
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": context + "\n\n" + question}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=16, do_sample=False)
        answers[method] = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answers["keydiff"].startswith("The magic number is 4217. This is a classic example of")
    assert "4217" not in answers["snapkv"]  # as the README says: its middle budget is 16 tokens here
