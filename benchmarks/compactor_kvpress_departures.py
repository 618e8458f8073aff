"""Compactor as the paper states it against kvpress's departures from it, one at a time and all together.

kvcompress's `compactor` follows Chari & Van Durme, "Compactor: Calibrated Query-Agnostic KV Cache
Compression with Approximate Leverage Scores" (arXiv 2507.08143): s = z(a) + 0.3·z(o) per head, leverage o
of the raw pre-RoPE keys, chunk attention a with the usual 1/sqrt(d) logit scale, mean-pooled over 7
tokens and then scaled by ||v||, every token scored. kvpress 0.5.5's `CompactorPress` departs from that in
six ways, read from its source: (1) leverage of mean-centred keys, (2) attention logits without the
1/sqrt(d) scale, (3) ||v|| applied before a 3-token pooling, (4) z-scores taken over every head of a layer
at once, (5) 8 first and 4 last tokens protected and left out of the scoring, (6) blending weight equal to
the compression ratio, with a 48-column sketch. Each departure here is a variant of the method (a
subclass registered in this process only); "kvpress" applies all six.

The samples are a dumped folder of `kvpress_side_by_side.py` (its `manifest.json` and `samples.jsonl`):
the same prompt tokens, greedy answers, stop rules and scorer. One recorded prefill per sample serves
every variant. One JSON line per sample goes to OUT/compactor_departures.jsonl (a rerun skips the samples
there); the table (score with its 95% Wilson interval, and the full cache's hits each variant keeps) is
printed and written to OUT/compactor_departures.md.

    .venv/bin/python benchmarks/compactor_kvpress_departures.py --out results/compactor_tuning --ratio 0.9
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvpress_side_by_side as harness  # noqa: E402  (the harness's file format, stop rules and helpers)

from kvcompress.eval.stats import wilson  # noqa: E402
from kvcompress.eval.tasks import score as task_score  # noqa: E402
from kvcompress.integration import generate_ids  # noqa: E402
from kvcompress.integration.capture import capture_qkv  # noqa: E402
from kvcompress.methods.compactor import Compactor, chunked_noncausal_attention, leverage_scores, own_queries  # noqa: E402
from kvcompress.methods.registry import register  # noqa: E402
from kvcompress.options import CompressionOptions  # noqa: E402


def layer_z(x: torch.Tensor) -> torch.Tensor:
    """z-score over every head and token of the layer at once (kvpress), not per head."""
    x = x.float()
    return (x - x.mean()) / x.std().clamp_min(1e-6)


def centred(keys: torch.Tensor) -> torch.Tensor:
    """Keys [B, H, n, d] less their mean over the tokens (kvpress's leverage input)."""
    return keys - keys.mean(-2, keepdim=True)


def unscaled(tokens):
    """The same tokens with attention scale 1: chunk attention logits q·k without the 1/sqrt(d) (kvpress)."""
    return replace(tokens, scale=1.0)


@register
@dataclass
class CentredLeverage(Compactor):
    """(1) leverage of the mean-centred pre-RoPE keys."""

    name = "compactor_centred"

    def blend(self, attention, pre_rope_keys, generator):
        return super().blend(attention, centred(pre_rope_keys), generator)


@register
@dataclass
class UnscaledAttention(Compactor):
    """(2) chunk attention logits q·k without the 1/sqrt(d) scale."""

    name = "compactor_unscaled"

    def attention_scores(self, tokens):
        return super().attention_scores(unscaled(tokens))


@register
@dataclass
class PoolAfterValueNorm(Compactor):
    """(3) ‖v‖ applied first, then a 3-token mean pool (zero padding counted, as F.avg_pool1d's default)."""

    name = "compactor_pool3"

    def attention_scores(self, tokens):
        a = chunked_noncausal_attention(own_queries(tokens), tokens.keys, tokens.scale, self.chunk_size)
        a = a * tokens.values.float().norm(dim=-1)
        b, h, n = a.shape
        return F.avg_pool1d(a.reshape(b * h, 1, n), 3, stride=1, padding=1).reshape(b, h, n)


@register
@dataclass
class LayerZ(Compactor):
    """(4) both scores z-scored over every head of the layer at once."""

    name = "compactor_layer_z"

    def blend(self, attention, pre_rope_keys, generator):
        outlier = layer_z(leverage_scores(pre_rope_keys, self.leverage, self.sketch, self.sketch_dim, generator))
        return layer_z(attention) + self.leverage_weight * outlier


@register
@dataclass
class KvpressCompactor(PoolAfterValueNorm, LayerZ):
    """All of kvpress's departures: (1)-(4) here (the pool of (3) and the layer z-scores of (4), on unscaled logits and
    centred keys); (5) and (6) are the options `kvpress_settings` adds."""

    name = "compactor_kvpress"

    def attention_scores(self, tokens):
        return super().attention_scores(unscaled(tokens))

    def blend(self, attention, pre_rope_keys, generator):
        return super().blend(attention, centred(pre_rope_keys), generator)


def kvpress_settings(ratio: float) -> dict:
    """(5) 8 + 4 protected tokens, (6) blending weight = ratio and a 48-column sketch."""
    return {"sink": 8, "window": 4, "leverage_weight": ratio, "sketch_dim": 48}


VARIANTS: dict[str, tuple[str, object]] = {
    "paper (kvcompress compactor)": ("compactor", lambda ratio: {}),
    "(1) centred keys": ("compactor_centred", lambda ratio: {}),
    "(2) unscaled logits": ("compactor_unscaled", lambda ratio: {}),
    "(3) ‖v‖ then 3-token pool": ("compactor_pool3", lambda ratio: {}),
    "(4) z over the layer": ("compactor_layer_z", lambda ratio: {}),
    "(5) 8 + 4 protected": ("compactor", lambda ratio: {"sink": 8, "window": 4}),
    "(6) weight = ratio, sketch 48": ("compactor", lambda ratio: {"leverage_weight": ratio, "sketch_dim": 48}),
    "all six (kvpress)": ("compactor_kvpress", kvpress_settings),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="a dumped folder of kvpress_side_by_side.py")
    p.add_argument("--ratio", type=float, default=0.9)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    manifest, samples = harness.load_samples(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = Path(manifest["checkpoint"])
    harness.check_checkpoint(manifest, checkpoint, skip=False)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    path = out / "compactor_departures.jsonl"
    done = {(r["sample"], r["ratio"]) for r in harness.read_jsonl(path)}
    for sample in samples:
        if (sample["id"], args.ratio) in done:
            continue
        context_ids, question_ids = torch.tensor([sample["context_ids"]]), torch.tensor([sample["question_ids"]])
        stop = harness.stop_ids_of(manifest, sample)
        captured = capture_qkv(model, context_ids)
        record = {"sample": sample["id"], "ratio": args.ratio, "answers": {}}
        for label, (method, settings) in [("full", (None, None)), *VARIANTS.items()]:
            if method is None:
                res = generate_ids(model, context_ids, question_ids, method=None, max_new_tokens=sample["max_new_tokens"],
                                   stop_token_ids=stop[1])
            else:
                options = CompressionOptions.build(method=method, compression_ratio=args.ratio, seed=manifest["samples"]["seed"],
                                                   **settings(args.ratio))
                res = generate_ids(model, context_ids, question_ids, options, max_new_tokens=sample["max_new_tokens"],
                                   stop_token_ids=stop[1], prefill=captured)
            prediction = tokenizer.decode(harness.trim_at_stop(list(res.token_ids), stop), skip_special_tokens=True).strip()
            hit = float(task_score(SimpleNamespace(task=sample["task"], answers=sample["answers"]), prediction))
            record["answers"][label] = {"prediction": prediction, "score": hit}
        harness.append_jsonl(path, record)
        print(sample["id"], {k: v["score"] for k, v in record["answers"].items()}, flush=True)
    records = [r for r in harness.read_jsonl(path) if r["ratio"] == args.ratio]
    full = [r["answers"]["full"]["score"] for r in records]
    lines = [f"Compactor's variants at ratio {args.ratio:g}, {len(records)} samples of `{out}` "
             f"(full cache: {sum(full):g} hits)", "",
             "| variant | score % (95% interval) | full cache's hits kept |", "|---|---|---|"]
    for label in VARIANTS:
        hits = [r["answers"][label]["score"] for r in records]
        low, high = wilson(sum(hits), len(hits))
        kept = sum(1 for h, f in zip(hits, full) if h == 1 and f == 1)
        lines.append(f"| {label} | {100 * sum(hits) / len(hits):.0f} ({100 * low:.0f}–{100 * high:.0f}) | {kept} of {sum(full):g} |")
    text = "\n".join(lines) + "\n"
    (out / "compactor_departures.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
