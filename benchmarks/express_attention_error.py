"""Thinformer Express attention error on real layers of the default model (the Express paper; docs/design.md, "Express, restated").

Captures post-RoPE q/k/v of a few layers of SmolLM2-135M-Instruct on real prose and reports the
relative error ‖z − Attn‖/‖Attn‖ of causal attention, averaged over seeds:

A. one kernel Halve of the middle (the default greedy walk and the randomised self-balancing walk,
   δ = 0.5) vs a uniform half (all weight 2), sink 32 and the last 256 tokens (the queries) exact;
B. the Express stream (sink 32, window 32) vs uniform sampling with as many middle slots, at
   checkpoints across the stream; the 64 queries after each checkpoint attend to the summary plus
   their own block exactly;
C. one-shot Express vs BalanceKV (and uniform) at equal memory, sink 32 + last 256 exact.

Writes benchmarks/results/express_attention_error.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.eval.capture import capture_qkv, prose_text
from kvcompress.methods.base import make_generator
from kvcompress.methods.express import halve_groups
from kvcompress.summary import KVSummary, concat
from kvcompress.eval.tables import write_csv

RESULTS = Path(__file__).parent / "results"
SINK, QUERY_WINDOW = 32, 256


def causal_error(queries, keys, values, summary, first_query):
    """Relative error of queries at positions first_query.. over `summary` vs exact causal attention over keys[:first_query + q]."""
    nq = queries.shape[2]
    exact = kvc.exact_attention(queries, keys[:, :, : first_query + nq], values[:, :, : first_query + nq], causal_offset=first_query)
    qpos = torch.arange(first_query, first_query + nq)
    return kvc.relative_error(kvc.weighted_attention(queries, summary, query_positions=qpos), exact)


def exact_part(keys, values, start, stop):
    return KVSummary.exact(keys[:, :, start:stop], values[:, :, start:stop], torch.arange(start, stop))


def uniform_sample(keys, values, start, stop, k, generator):
    """k of the tokens start:stop per head, uniformly without replacement, each weighing (stop - start) / k."""
    b, h = keys.shape[:2]
    scores = torch.rand(b, h, stop - start, generator=generator)
    index = scores.topk(k, dim=-1).indices.sort(dim=-1).values + start
    pick = lambda t: t.gather(2, index.unsqueeze(-1).expand(*index.shape, t.shape[-1]))
    return KVSummary(pick(keys), pick(values), torch.full(index.shape, math.log((stop - start) / k)), index)


def part_a(layer, q, k, v, seeds):
    n = k.shape[2]
    stop = n - QUERY_WINDOW
    stop -= (stop - SINK) % 2
    middle = exact_part(k, v, SINK, stop)
    queries = q[:, :, n - QUERY_WINDOW :]
    edges = (exact_part(k, v, 0, SINK), exact_part(k, v, stop, n))
    rows = []
    for seed in range(seeds):
        greedy = halve_groups(middle, middle.num_slots, k.shape[-1] ** -0.5, make_generator(seed), None)
        balancing = halve_groups(middle, middle.num_slots, k.shape[-1] ** -0.5, make_generator(seed), 0.5)
        uni = uniform_sample(k, v, SINK, stop, middle.num_slots // 2, make_generator(seed))
        for name, s in (("kernel halving (greedy)", greedy), ("kernel halving (self-balancing)", balancing), ("uniform half", uni)):
            rows.append(dict(part="A", layer=layer, method=name, tokens=n, slots=s.num_slots, seed=seed,
                             error=causal_error(queries, k, v, concat([edges[0], s, edges[1]]), n - QUERY_WINDOW)))
    return rows


def part_b(layer, q, k, v, budget, seeds, block=64):
    n = k.shape[2]
    rows = []
    for seed in range(seeds):
        st = kvc.stream("express", budget=budget, sink=SINK, window=32, seed=seed)
        for t in range(0, n - block, block):
            st.update(k[:, :, t : t + block], v[:, :, t : t + block])
            seen = t + block
            if seen < 512 or seen % 256:
                continue
            queries = q[:, :, seen : seen + block]
            now = exact_part(k, v, seen, seen + block)
            middle = st.state.summary()
            slots = middle.num_slots
            uni = uniform_sample(k, v, SINK, seen - 32, slots, make_generator(seed))
            edges = (exact_part(k, v, 0, SINK), exact_part(k, v, seen - 32, seen))
            for name, s in (("express", middle), ("uniform", uni)):
                summary = concat([edges[0], s, edges[1], now])
                rows.append(dict(part="B", layer=layer, method=name, tokens=seen, slots=slots, seed=seed,
                                 error=causal_error(queries, k, v, summary, seen)))
    return rows


def part_c(layer, q, k, v, budgets, seeds):
    n = k.shape[2]
    queries = q[:, :, n - QUERY_WINDOW :]
    ctx_k, ctx_v = k[:, :, : n - QUERY_WINDOW], v[:, :, : n - QUERY_WINDOW]
    edges = exact_part(k, v, n - QUERY_WINDOW, n)
    rows = []
    methods = [("express", {}), ("random", {"weighted": True})]
    if "balancekv" in kvc.methods():
        methods.insert(1, ("balancekv", {}))
    for budget in budgets:
        for seed in range(seeds):
            for name, params in methods:
                s = kvc.compress(name, ctx_k, ctx_v, budget=budget, sink=SINK, window=0, seed=seed, **params)
                rows.append(dict(part="C", layer=layer, method=name, tokens=n, slots=s.num_slots - SINK, seed=seed,
                                 error=causal_error(queries, k, v, concat([s, edges]), n - QUERY_WINDOW), budget=budget))
    return rows


def summarise(rows):
    groups = {}
    for r in rows:
        key = (r["part"], r["layer"], r.get("budget", ""), r["tokens"], r["method"])
        groups.setdefault(key, []).append(r)
    out = []
    for (part, layer, budget, tokens, method), rs in sorted(groups.items(), key=lambda x: tuple(map(str, x[0]))):
        errs = [r["error"] for r in rs]
        out.append(dict(part=part, layer=layer, budget=budget, tokens=tokens, method=method,
                        slots=round(statistics.mean(r["slots"] for r in rs), 1),
                        mean_error=statistics.mean(errs), std_error=statistics.stdev(errs) if len(errs) > 1 else 0.0, seeds=len(errs)))
    return out


def write(rows, summary):
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_csv(RESULTS / "express_attention_error.csv", summary)
    lines = ["# Express attention error on real layers (SmolLM2-135M-Instruct, real prose)", ""]
    titles = {"A": "A. One Halve vs uniform half", "B": "B. Express stream vs uniform at equal middle slots",
              "C": "C. One-shot, equal budget (sink 32 + last 256 exact)"}
    for part in "ABC":
        sel = [r for r in summary if r["part"] == part]
        if not sel:
            continue
        lines += [f"## {titles[part]}", "", "| layer | budget | tokens | method | middle slots | rel. error (mean ± std over seeds) |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['layer']} | {r['budget']} | {r['tokens']} | {r['method']} | {r['slots']} | "
                  f"{r['mean_error']:.4f} ± {r['std_error']:.4f} |" for r in sel]
        lines.append("")
    (RESULTS / "express_attention_error.md").write_text("\n".join(lines), encoding="utf-8")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for layer in sorted({r["layer"] for r in summary}):
        for method, style in (("express", "-"), ("uniform", "--")):
            pts = [r for r in summary if r["part"] == "B" and r["layer"] == layer and r["method"] == method]
            axes[0].plot([r["tokens"] for r in pts], [r["mean_error"] for r in pts], style, label=f"L{layer} {method}")
    axes[0].set(xlabel="tokens seen", ylabel="relative error", title="Express stream vs uniform (equal slots)")
    axes[0].legend(fontsize=7)
    sel = [r for r in summary if r["part"] == "C"]
    for method in sorted({r["method"] for r in sel}):
        pts = [r for r in sel if r["method"] == method]
        budgets = sorted({r["budget"] for r in pts})
        axes[1].plot(budgets, [statistics.mean(r["mean_error"] for r in pts if r["budget"] == b) for b in budgets], "o-", label=method)
    axes[1].set(xlabel="budget (middle slots)", ylabel="relative error (mean over layers)", title="One-shot at equal budget")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "express_attention_error.png", dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 10, 18, 26])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--stream-budget", type=int, default=192)
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = kvc.load_model()
    captured = capture_qkv(model, tokenizer, prose_text(seed=0), layers=args.layers, max_tokens=args.tokens)
    rows = []
    for layer, (q, k, v) in captured.items():
        q, k, v = q.float(), k.float(), v.float()
        rows += part_a(layer, q, k, v, 2 * args.seeds)
        rows += part_b(layer, q, k, v, args.stream_budget, args.seeds)
        rows += part_c(layer, q, k, v, args.budgets, args.seeds)
        print(f"layer {layer} done", flush=True)
    summary = summarise(rows)
    write(rows, summary)
    print((RESULTS / "express_attention_error.md").read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
