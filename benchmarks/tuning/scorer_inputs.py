"""What would make KVzap's surrogate predict KVzip's scores better: more training text, a ridge, an MLP, the hidden
states of the neighbouring tokens beside the token's own, or what the token's key and value say about it within its
context (tuning, on the default model).

KVzip's exact scores (`integration.scorer_training.scoring_pairs`) are computed once for three texts: the tuning
contexts (`eval.capture.DOCSTRING_MODULES`, what `kvcompress train-scorer` reports its fit on), the training text
`kvcompress train-scorer` uses (`SCORER_TRAINING_MODULES`) and EXTRA_MODULES (every other standard-library module with
prose docstrings, none of the tuning, training or held-out lists). Each variant is fitted on the training pairs of
`--layers` and scored on the tuning contexts: Spearman's correlation with KVzip's scores, and the share of KVzip's top
25 % and top 10 % per head that the surrogate also ranks there (what ratios 0.75 and 0.9 keep), means over the layers'
heads. The context's features, beside the hidden state, per KV head: the log norms of the token's (pre-RoPE) key and
value, and the cosine of its key with the mean key of its context up to it (what a stream can keep as it goes, as
KeyDiff's score does). `--cache DIR` keeps the scored pairs (`pairs_<text>.pt`), so a rerun only fits.

    .venv/bin/python benchmarks/tuning/scorer_inputs.py --cache /tmp/scorer_pairs --threads 2 \\
        --out benchmarks/results/tuning/scorer_inputs.csv
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.eval.capture import DOCSTRING_MODULES, HELDOUT_MODULES, SCORER_TRAINING_MODULES, docstring_paragraphs
from kvcompress.eval.tables import write_csv
from kvcompress.integration.scorer_training import scoring_pairs, text_contexts
from kvcompress.methods.kvzap import fit_surrogate, spearman

# Standard-library modules with prose docstrings in none of DOCSTRING_MODULES, SCORER_TRAINING_MODULES, HELDOUT_MODULES.
EXTRA_MODULES = tuple("""
turtle tkinter.tix fileinput _pyio tkinter.dnd aifc sunau email.quoprimime email.charset tkinter.ttk tkinter wave cgi
email.policy py_compile asyncio.tasks wsgiref.simple_server telnetlib asyncio.locks asyncio.unix_events pyclbr
xml.sax.xmlreader bdb pipes email.base64mime email._policybase xmlrpc.server importlib.util xml.sax.handler plistlib imp
unittest.async_case posixpath dbm xml.dom.expatbuilder xml.sax.saxutils getpass quopri ntpath asyncio.protocols
wsgiref.util runpy asyncore zipapp importlib.abc asynchat email.feedparser asyncio.runners concurrent.futures._base
webbrowser dis hmac linecache mailcap cgitb email.header signal multiprocessing.shared_memory asyncio.queues chunk cProfile
curses.textpad dbm.dumb lib2to3.pytree tabnanny numbers glob email.generator asyncio.staggered lib2to3.pgen2.driver fnmatch
html.parser secrets sndhdr _pydecimal multiprocessing.managers html copy genericpath codeop asyncio.sslproto types
unittest.util email.iterators tracemalloc urllib.error unittest.suite asyncio.timeouts crypt tkinter.filedialog tkinter.font
wsgiref.validate poplib xml.dom.minicompat asyncio.transports importlib nntplib rlcompleter json.decoder ctypes
encodings.idna compileall curses unittest.result encodings multiprocessing.connection lib2to3.refactor lib2to3.fixer_base
json.encoder tkinter.scrolledtext asyncio.taskgroups operator colorsys smtpd unittest.runner urllib.robotparser
wsgiref.headers asyncio.selector_events
""".split())


def shifted(x: torch.Tensor, offset: int) -> torch.Tensor:
    """[N, d]: row i holds x[i + offset] (zeros past either end)."""
    out = torch.zeros_like(x)
    if offset > 0:
        out[:-offset] = x[offset:]
    elif offset < 0:
        out[-offset:] = x[:offset]
    else:
        out[:] = x
    return out


def neighbours(x: torch.Tensor, layer: int, lengths: list[int]) -> torch.Tensor:
    """[N, 3d]: each token's hidden state beside its predecessor's and its successor's, over the contexts laid end to end
    (the committed record was measured so: a context's last token sees the next context's first, 2 tokens in each
    ~2,000). `layer` and `lengths` are read by the other inputs (`context_features`), not by this one."""
    return torch.cat([shifted(x, -1), x, shifted(x, 1)], 1)


def top_share(predicted: torch.Tensor, target: torch.Tensor, keep: float) -> float:
    """The share of target's top `keep` per head [H, n] that predicted also ranks in its top `keep`, mean over heads."""
    k = max(1, int(keep * target.shape[-1]))
    mine = torch.zeros_like(target, dtype=torch.bool).scatter_(-1, predicted.topk(k, -1).indices, True)
    theirs = torch.zeros_like(target, dtype=torch.bool).scatter_(-1, target.topk(k, -1).indices, True)
    return ((mine & theirs).sum(-1).float() / k).mean().item()


SINK = 4  # the leading tokens `scoring_pairs` leaves out of each context


def scored_text(model, tokenizer, name: str, paragraphs: list[str], contexts: int, cache: Path | None, tokens: int = 2048) -> dict:
    """{"hidden": {layer: [N, d]}, "targets": {layer: [H, N]}, "lengths": the rows of each context} of `paragraphs` in at
    most `contexts` contexts of `tokens` tokens (the pairs cached by name; the contexts' lengths re-tokenised, which is cheap)."""
    ids = text_contexts(tokenizer, paragraphs, tokens, contexts, seed=0)
    lengths = [i.shape[1] - SINK for i in ids]
    path = cache / f"pairs_{name}.pt" if cache is not None else None
    if path is not None and path.is_file():
        out = torch.load(path)
    else:
        pairs = scoring_pairs(model, tokenizer, ids, sink=SINK, progress=print)
        out = {"hidden": pairs.hidden, "targets": pairs.targets}
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(out, path)
    rows = next(iter(out["hidden"].values())).shape[0]
    if rows != sum(lengths):
        raise ValueError(f"{name}: {rows} scored tokens, but its contexts hold {sum(lengths)}")
    return out | {"lengths": lengths}


@torch.no_grad()
def context_features(model, hidden: torch.Tensor, layer: int, lengths: list[int], which: tuple[str, ...]) -> torch.Tensor:
    """[N, d + f]: each token's hidden state and, per KV head, the features named in `which` ("norms": log ‖k‖, log ‖v‖
    of its pre-RoPE key and value; "cosine": the cosine of its key with the mean key of its context up to it), the
    contexts (`lengths` rows each) taken apart."""
    attention = model.model.layers[layer].self_attn
    heads = model.config.num_key_value_heads
    parts = []
    for h in hidden.split(lengths):
        h = h.float()
        keys = attention.k_proj(h).unflatten(-1, (heads, -1))
        features = [h]
        if "norms" in which:
            features += [keys.norm(dim=-1).log(), attention.v_proj(h).unflatten(-1, (heads, -1)).norm(dim=-1).log()]
        if "cosine" in which:
            running = keys.cumsum(0) / torch.arange(1, len(h) + 1)[:, None, None]
            features.append(torch.nn.functional.cosine_similarity(keys, running, dim=-1))
        parts.append(torch.cat(features, 1))
    return torch.cat(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cache", type=Path, default=None, help="folder keeping the scored pairs between runs")
    p.add_argument("--layers", default="0,10,20,29", help="the layers fitted and scored (default 0,10,20,29)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per context (default 2048)")
    p.add_argument("--contexts", type=int, default=100,
                   help="at most this many contexts of the training and the extra text, and at most 3 of the tuning text (default 100: all)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvc.load_model()
    tuning_text = docstring_paragraphs(DOCSTRING_MODULES)
    held_apart = set(tuning_text) | set(docstring_paragraphs(HELDOUT_MODULES))
    training_text = [t for t in docstring_paragraphs(SCORER_TRAINING_MODULES) if t not in held_apart]
    held_apart |= set(training_text)
    extra_text = [t for t in docstring_paragraphs(EXTRA_MODULES) if t not in held_apart]
    tuning = scored_text(model, tokenizer, "tuning", tuning_text, min(3, args.contexts), args.cache, args.tokens)
    training = scored_text(model, tokenizer, "training", training_text, args.contexts, args.cache, args.tokens)
    extra = scored_text(model, tokenizer, "extra", extra_text, args.contexts, args.cache, args.tokens)
    layers = [int(x) for x in args.layers.split(",")]
    half_lengths = training["lengths"][: len(training["lengths"]) // 2]  # the first half of the training contexts
    half = sum(half_lengths)
    both = {"hidden": {i: torch.cat([training["hidden"][i], extra["hidden"][i]]) for i in layers},
            "targets": {i: torch.cat([training["targets"][i], extra["targets"][i]], 1) for i in layers},
            "lengths": training["lengths"] + extra["lengths"]}
    first_half = {"hidden": {i: training["hidden"][i][:half] for i in layers}, "targets": {i: training["targets"][i][:, :half] for i in layers},
                  "lengths": half_lengths}
    identity = lambda x, layer, lengths: x  # noqa: E731

    def context(*which):
        return lambda x, layer, lengths: context_features(model, x, layer, lengths, which)

    # name -> (training pairs, input of a token, kind, fit options)
    variants = {
        "linear, half the training text": (first_half, identity, "linear", {}),
        "linear, the training text (train-scorer's)": (training, identity, "linear", {}),
        "linear, training + extra text": (both, identity, "linear", {}),
        "linear, training + extra text, ridge 1e-3": (both, identity, "linear", {"ridge": 1e-3}),
        "linear, training + extra text, ridge 1e-1": (both, identity, "linear", {"ridge": 1e-1}),
        "linear, training + extra text, neighbours' hidden states": (both, neighbours, "linear", {}),
        "mlp (16 units, 300 steps), training + extra text": (both, identity, "mlp", {}),
        "linear, the training text, + key and value norms": (training, context("norms"), "linear", {}),
        "linear, the training text, + the key's cosine with the context's mean key": (training, context("cosine"), "linear", {}),
        "linear, the training text, + both": (training, context("norms", "cosine"), "linear", {}),
    }
    rows = []
    for name, (pairs, inputs, kind, options) in variants.items():
        start = time.perf_counter()
        surrogate = fit_surrogate({i: inputs(pairs["hidden"][i], i, pairs["lengths"]) for i in layers},
                                  {i: pairs["targets"][i] for i in layers}, kind, **options)
        seconds = time.perf_counter() - start
        fidelity = {"spearman": [], "top_25": [], "top_10": []}
        for layer in layers:
            x, target = inputs(tuning["hidden"][layer], layer, tuning["lengths"]), tuning["targets"][layer]
            predicted = surrogate.predict(x[None, None].expand(1, surrogate.kv_heads, -1, -1), layer)[0]
            fidelity["spearman"].append(spearman(predicted, target))
            fidelity["top_25"].append(top_share(predicted, target, 0.25))
            fidelity["top_10"].append(top_share(predicted, target, 0.10))
        row = {"variant": name, "training_tokens": pairs["hidden"][layers[0]].shape[0], "layers": args.layers}
        row |= {f"{k}_mean": round(sum(v) / len(v), 4) for k, v in fidelity.items()}
        row |= {"per_layer_spearman": " ".join(f"{v:.3f}" for v in fidelity["spearman"]), "fit_s": round(seconds, 1),
                "tuning_tokens": tuning["hidden"][layers[0]].shape[0], "threads": args.threads,
                "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "date": time.strftime("%Y-%m-%d")}
        rows.append(row)
        print({k: row[k] for k in ("variant", "training_tokens", "spearman_mean", "top_25_mean", "top_10_mean")}, flush=True)
    write_csv(args.out, rows)


if __name__ == "__main__":
    main()
