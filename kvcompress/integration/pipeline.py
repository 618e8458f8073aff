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

from .model import DEFAULT_PROMPT_LAYOUT, build_prompt, check_questions
from .model import prompt_layout as _layout

TASK = "kvcompress-text-generation"


class CompressedTextGenerationPipeline(Pipeline):
    """pipe(context, question=None | questions=[...], answer_prefix="", prompt_layout=DEFAULT_PROMPT_LAYOUT, method=...,
    compression_ratio=... | budget=..., mode="prefill", max_new_tokens=64, **options) -> {"answer", "result"} or {"answers", "results"}.

    prompt_layout: how each question follows the context (`build_prompt`'s layout: a
    `PromptLayout` or its name); a primed layout starts every answer with `answer_prefix`.

    options are `generate_ids`' (sink, window, seed, chunk_size, method parameters, ...); results
    are the `GenerationResult`s (stats: kept slots, KV bytes, the shared prefill time, each
    question's decode time).
    """

    _load_tokenizer = True
    _pipeline_calls_generate = True

    def __call__(self, inputs, *args, batch_size=None, **kwargs):
        """One context, or a list of contexts run one after the other (each compressed alone); a `batch_size` above 1, here
        or when the pipeline was built, is refused: transformers would collate several contexts into one call."""
        size = batch_size if batch_size is not None else self._batch_size
        if size not in (None, 1):
            raise ValueError(f"batch_size={size}: the kvcompress pipeline compresses one context per call (a list of contexts runs them "
                             "one after the other); for one forward over several contexts use kvc.generate with a list of contexts")
        return super().__call__(inputs, *args, **kwargs)

    def _sanitize_parameters(self, question=None, questions=None, answer_prefix="", prompt_layout=DEFAULT_PROMPT_LAYOUT, **options):
        check_questions(question, questions)
        layout = _layout(prompt_layout, parameter="prompt_layout")
        return {"question": question, "questions": questions, "answer_prefix": answer_prefix, "layout": layout}, options, {"single": questions is None}

    def preprocess(self, context, question=None, questions=None, answer_prefix="", layout=DEFAULT_PROMPT_LAYOUT):
        if not isinstance(context, str) or not context.strip():
            raise ValueError(f"context must be a non-empty string, got {context!r:.80}")
        asked = questions if questions is not None else [question]
        context_ids, _ = build_prompt(self.tokenizer, context, asked[0], answer_prefix, layout)
        return {"context_ids": context_ids, "questions_ids": [build_prompt(self.tokenizer, context, q, answer_prefix, layout)[1] for q in asked]}

    def _forward(self, inputs, **settings):
        from .generation import answer_questions_ids  # the generation path loads on first use, not at registration

        return {"results": answer_questions_ids(self.model, inputs["context_ids"], inputs["questions_ids"], **settings)}

    def postprocess(self, outputs, single=True):
        results = outputs["results"]
        for res in results:
            res.text = self.tokenizer.decode(res.token_ids, skip_special_tokens=True).strip()
        if single:
            return {"answer": results[0].text, "result": results[0]}
        return {"answers": [res.text for res in results], "results": results}


PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=CompressedTextGenerationPipeline, pt_model=AutoModelForCausalLM)
