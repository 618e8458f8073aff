"""The `kvcompress-text-generation` transformers pipeline: many questions about one context, compressed once.

    from transformers import pipeline
    pipe = pipeline("kvcompress-text-generation", model=model, tokenizer=tokenizer)
    out = pipe(context, questions=["Who?", "When?"], method="snapkv", compression_ratio=0.5, max_new_tokens=32)
    out["answers"]        # one answer per question ("answer" for question="...")

Registered on import of `kvcompress.integration` (as kvpress registers `kv-press-text-generation`).
The context goes through the chat template (`build_prompt`, in `prompt_layout`), is prefilled and compressed once,
and each question decodes from a snapshot of the compressed cache (`answer_questions_ids`).
"""

from __future__ import annotations

from transformers import AutoModelForCausalLM, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from ..checks import as_count
from .model import DEFAULT_PROMPT_LAYOUT, PROMPT_LAYOUTS, build_prompt, check_questions
from .model import prompt_layout as _layout

TASK = "kvcompress-text-generation"


class CompressedTextGenerationPipeline(Pipeline):
    """pipe(context, question=None | questions=[...], answer_prefix="", prompt_layout=DEFAULT_PROMPT_LAYOUT, method=...,
    compression_ratio=... | budget=..., mode="prefill", max_new_tokens=64, **options) -> {"answer", "result"} or {"answers", "results"}.

    prompt_layout: how each question follows the context (`build_prompt`'s layout: a
    `PromptLayout` or its name); a primed layout starts every answer with `answer_prefix`.

    options are `generate_ids`' (sink, window, seed, chunk_size, method parameters, ...); results
    are the `GenerationResult`s (stats: kept slots, KV bytes, the shared prefill time, each
    question's decode time). Every setting may be given when the pipeline is built
    (`pipeline(..., method="snapkv", compression_ratio=0.5)`) or at a call, where it replaces the
    built one. A non-empty answer_prefix needs a primed layout; answers do not repeat it. Methods
    scored by KVzip's reconstruction get the repeat instruction `kvc.generate` gives them, so the
    pipeline and `kvc.generate` build the same cache.
    """

    _load_tokenizer = True
    # False: transformers would take generation keys given when the pipeline is built (max_new_tokens, do_sample, ...)
    # for a `generate` call this pipeline does not make; they reach `_sanitize_parameters` as at call time instead.
    _pipeline_calls_generate = False

    def __call__(self, inputs, *args, batch_size=None, **kwargs):
        """One context, or a non-empty list of contexts run one after the other (each compressed alone); a `batch_size`
        above 1, here or when the pipeline was built, is refused: transformers would collate several contexts into one call."""
        size = batch_size if batch_size is not None else self._batch_size
        if size is not None and as_count("batch_size", size, 1) != 1:
            raise ValueError(f"batch_size={size!r}: the kvcompress pipeline compresses one context per call (a list of contexts runs "
                             "them one after the other); for one forward over several contexts use kvc.generate with a list of contexts")
        if isinstance(inputs, (list, tuple)) and not inputs:
            raise ValueError(f"inputs must be a context string or a non-empty list of them, got {inputs!r}")
        return super().__call__(inputs, *args, **kwargs)

    def _sanitize_parameters(self, **settings):
        """The settings given (when the pipeline is built, or at a call, which transformers merges over them), split into
        the prompt's (question, questions, answer_prefix, prompt_layout) and the generation's; defaults are applied in
        `preprocess` and `answer_questions_ids`, so a call's unset setting keeps what the pipeline was built with."""
        prompt = {k: settings.pop(k) for k in _PROMPT_SETTINGS if k in settings}
        for one, other in (("question", "questions"), ("questions", "question")):  # alternatives: one given replaces both
            if prompt.get(one) is not None and other not in prompt:
                prompt[other] = None
        return prompt, settings, {}

    def preprocess(self, context, question=None, questions=None, answer_prefix="", prompt_layout=DEFAULT_PROMPT_LAYOUT):
        check_questions(question, questions)
        layout = _layout(prompt_layout, parameter="prompt_layout")
        if isinstance(answer_prefix, str) and answer_prefix and not layout.primed:  # build_prompt refuses one not a str
            raise ValueError(f"answer_prefix={answer_prefix!r} starts the answer in a primed prompt layout only; prompt_layout="
                             f"{prompt_layout!r} is not primed (primed: {', '.join(n for n, l in PROMPT_LAYOUTS.items() if l.primed)})")
        if not isinstance(context, str) or not context.strip():
            raise ValueError(f"context must be a non-empty string, got {context!r:.80}")
        asked = questions if questions is not None else [question]
        context_ids, _ = build_prompt(self.tokenizer, context, asked[0], answer_prefix, layout)
        return {"context_ids": context_ids, "questions_ids": [build_prompt(self.tokenizer, context, q, answer_prefix, layout)[1] for q in asked],
                "single": questions is None}

    def _forward(self, inputs, **settings):
        from .generation import answer_questions_ids, build_options  # loaded on first use, not at registration
        from .reconstruction import with_repeat_prompt

        run = {k: settings.pop(k) for k in _RUN_SETTINGS if k in settings}
        options = with_repeat_prompt(build_options(None, **settings), self.tokenizer)  # as kvc.generate builds them
        results = answer_questions_ids(self.model, inputs["context_ids"], inputs["questions_ids"], options, **run)
        return {"results": results, "single": inputs["single"]}

    def postprocess(self, outputs):
        results = outputs["results"]
        for res in results:
            res.text = self.tokenizer.decode(res.token_ids, skip_special_tokens=True).strip()
        if outputs["single"]:
            return {"answer": results[0].text, "result": results[0]}
        return {"answers": [res.text for res in results], "results": results}


_PROMPT_SETTINGS = ("question", "questions", "answer_prefix", "prompt_layout")
_RUN_SETTINGS = ("max_new_tokens", "stop_at_eos", "progress")  # answer_questions_ids' own; the rest are CompressionOptions


PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=CompressedTextGenerationPipeline, pt_model=AutoModelForCausalLM)
