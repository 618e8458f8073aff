"""Long-form decoding with Thinformer Express on the default model (seed 003, "memory-efficient long-form decoding").

1. A long greedy generation (default 1,536 new tokens, EOS ignored) with mode="decode": the cache
   stays bounded (every attention call sees ≤ sink + budget + window stored slots plus the new
   token; max and mean over all calls are reported), and the time spent updating the
   Express cache (the streams' absorb, `compress_seconds`) is reported against the time spent
   attending over it (every call of the 'kvcompress' attention function's weighted_attention).
2. Next-token agreement with full-cache greedy decoding over the first 256 new tokens, for
   Express, StreamingLLM and KeyDiff at the same cache size (stored slots per KV head, sink +
   middle budget + window with each method's seed defaults; Express's state fills it only at the
   peak of its base-4 cycle, so its mean is lower): the full-cache
   greedy continuation is fed token by token through each compressed cache (teacher forcing) and
   the compressed cache's argmax is compared with the full-cache token at every step; the length
   of the identical prefix of a free-running greedy generation is reported too.

Writes benchmarks/results/express_decode.{csv,md}.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import kvcompress as kvc
import kvcompress.integration.attention as attention_module
from kvcompress.api import default_sink_window
from kvcompress.cache import CompressedCache, CompressionSettings
from kvcompress.eval.capture import prose_text
from kvcompress.integration.generate import generate_ids, use_compressed_attention
from kvcompress.integration.model import build_prompt
from kvcompress.methods.base import build_method
from kvcompress.eval.tables import write_csv

RESULTS = Path(__file__).parent / "results"


class AttentionTimer:
    """Times every weighted_attention call the 'kvcompress' attention function makes and records the
    slots every single-token (decode) call attends to: the stored cache plus the new token."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0
        self.max_slots = 0
        self.total_slots = 0
        self.inner = attention_module.weighted_attention

    def __enter__(self):
        def timed(queries, summary, *args, **kwargs):
            start = time.perf_counter()
            out = self.inner(queries, summary, *args, **kwargs)
            self.seconds += time.perf_counter() - start
            if queries.shape[2] == 1:
                self.calls += 1
                self.max_slots = max(self.max_slots, summary.num_slots)
                self.total_slots += summary.num_slots
            return out

        attention_module.weighted_attention = timed
        return self

    def __exit__(self, *exc):
        attention_module.weighted_attention = self.inner


def teacher_forced_agreement(model, prompt_ids, reference, method, budget, chunk_size=128):
    """Fraction of steps where the compressed cache's argmax equals the full-cache greedy token, feeding `reference`."""
    sink, window = default_sink_window(method, None, None)
    settings = CompressionSettings(build_method(method), "decode", budget, None, sink, window, 0)
    cache = CompressedCache(model, settings)
    agree = 0
    with use_compressed_attention(model), torch.no_grad():
        for block in prompt_ids.split(chunk_size, dim=1):
            logits = model(block, past_key_values=cache, use_cache=True).logits[:, -1]
        for token in reference:
            agree += int(logits.argmax(-1)) == token
            logits = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[:, -1]
    return agree / len(reference)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-size", type=int, default=254,
                        help="stored slots per KV head for every method: sink + middle budget + window (Express: 32 + 190 + 32, m = 32)")
    parser.add_argument("--long-tokens", type=int, default=1536)
    parser.add_argument("--agree-tokens", type=int, default=256)
    parser.add_argument("--context-chars", type=int, default=1500)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = kvc.load_model()
    context = prose_text(args.context_chars, seed=1)
    question = "Summarise the text above in detail, then explain each concept it mentions step by step."
    ctx_ids, q_ids = build_prompt(tokenizer, context, question)
    prompt = torch.cat([ctx_ids, q_ids], 1)
    budget = {m: args.cache_size - sum(default_sink_window(m, None, None)) for m in ("express", "streamingllm", "keydiff")}
    rows = []

    with torch.no_grad(), AttentionTimer() as timer:
        long = generate_ids(model, ctx_ids, q_ids, method="express", budget=budget["express"], mode="decode",
                            max_new_tokens=args.long_tokens, stop_at_eos=False)
    bound = args.cache_size + 1  # the new token attends to the stored cache and itself
    rows.append(dict(experiment="long decode", method="express", new_tokens=len(long.token_ids), prompt_tokens=long.prompt_tokens,
                     max_slots_per_layer=timer.max_slots, mean_slots=round(timer.total_slots / timer.calls, 1), slot_bound=bound,
                     update_seconds=round(long.compress_seconds, 3), attention_seconds=round(timer.seconds, 3),
                     update_over_attention=round(long.compress_seconds / timer.seconds, 4),
                     decode_seconds=round(long.decode_seconds, 2), agreement="", identical_prefix=""))
    print(rows[-1], flush=True)

    with torch.no_grad():
        full = generate_ids(model, ctx_ids, q_ids, method=None, max_new_tokens=args.agree_tokens, stop_at_eos=False)
    reference = full.token_ids
    for method in budget:
        with torch.no_grad():
            with AttentionTimer() as seen:
                agreement = teacher_forced_agreement(model, prompt, reference, method, budget[method])
            free = generate_ids(model, ctx_ids, q_ids, method=method, budget=budget[method], mode="decode",
                                max_new_tokens=args.agree_tokens, stop_at_eos=False)
        prefix = next((i for i, (a, b) in enumerate(zip(free.token_ids, reference)) if a != b), len(reference))
        rows.append(dict(experiment=f"agreement, first {len(reference)} tokens", method=method, new_tokens=len(reference),
                         prompt_tokens=full.prompt_tokens, max_slots_per_layer=seen.max_slots,
                         mean_slots=round(seen.total_slots / seen.calls, 1),
                         slot_bound=args.cache_size + 1,
                         update_seconds="", attention_seconds="", update_over_attention="", decode_seconds="",
                         agreement=round(agreement, 4), identical_prefix=prefix))
        print(rows[-1], flush=True)

    RESULTS.mkdir(parents=True, exist_ok=True)
    write_csv(RESULTS / "express_decode.csv", rows)
    cols = list(rows[0])
    lines = ["# Express long-form decoding (SmolLM2-135M-Instruct, CPU, greedy)", "",
             f"cache size {args.cache_size} stored slots per KV head for every method (sink/window per method's seed "
             f"defaults, middle budgets {budget}); slot columns count what each decode step attends to, "
             "the stored cache plus the new token", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    (RESULTS / "express_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
