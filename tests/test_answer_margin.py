"""benchmarks/answer_margin.py: the full cache's margin for its own answer, and the table by whether cells keep it."""

import json

import pytest
import torch
from test_needle_retention import _load, harness  # the benchmark-module loader and the harness module

margin = _load("answer_margin")
from test_kvpress_harness import tiny_run  # noqa: E402,F401


def test_thirds_split_by_rank():
    assert margin.thirds([5.0, 1.0, 3.0, 2.0, 4.0, 0.0]) == [[5, 1], [3, 2], [4, 0]]
    assert [len(g) for g in margin.thirds([float(i) for i in range(7)])] == [2, 3, 2]


def test_margins_match_one_forward_per_step_and_the_full_cache_answer_is_its_top_choice(tiny_run):
    (tiny_run / "margin.jsonl").unlink(missing_ok=True)
    margin.main(["--out", str(tiny_run)])
    rows = [json.loads(line) for line in (tiny_run / "margin.jsonl").read_text().splitlines()]
    manifest, samples = harness.load_samples(tiny_run)
    records = {r["key"]: r for r in harness.read_records(tiny_run)}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(manifest["checkpoint"], dtype=torch.float32).eval()
    assert [r["sample"] for r in rows] == [s["id"] for s in samples]
    for row, sample in zip(rows, samples):
        answer = records[harness.cell_key("kvcompress", "full", None, sample["id"])]["token_ids"]
        assert len(row["margins"]) == len(row["runner_up"]) == len(answer) > 0
        prompt = sample["context_ids"] + sample["question_ids"]
        for i, token in enumerate(answer):
            with torch.no_grad():
                log_probs = model(torch.tensor([prompt + answer[:i]])).logits[0, -1].log_softmax(-1)
            other = log_probs.clone()
            other[token] = -torch.inf
            assert row["margins"][i] == pytest.approx((log_probs[token] - other.max()).item(), abs=1e-4)
            assert row["margins"][i] >= -1e-4  # greedy: the recorded token is the top choice
    margin.main(["--out", str(tiny_run)])  # done: nothing added
    assert len((tiny_run / "margin.jsonl").read_text().splitlines()) == len(rows)


def test_table_splits_the_full_cache_hits_by_what_each_cell_keeps(tmp_path):
    rows = [{"sample": f"s{i}", "index": i, "full_score": 1.0 if i < 6 else 0.0, "answer": f"a{i}",
             "margins": [float(i), 0.5], "runner_up": ["the", "."]} for i in range(7)]
    kept_by_cell = {"knorm": [0, 0, 1, 1, 1, 1], "keydiff": [1, 1, 1, 1, 1, 1]}
    records = [{"library": "kvcompress", "cell": cell, "ratio": 0.5, "sample": f"s{i}", "score": float(k)}
               for cell, kept in kept_by_cell.items() for i, k in enumerate(kept)]
    records.append({"library": "kvcompress", "cell": "full", "ratio": None, "sample": "s0", "score": 1.0})
    margin.write_tables(tmp_path / "margin.md", rows, records)
    text = (tmp_path / "margin.md").read_text()
    assert "hits: 6 of 7 samples" in text and "thirds by margin 0.00–1.00, 2.00–3.00, 4.00–5.00" in text
    assert "| kvcompress | knorm | 0.5 | 4 of 6 | 3.50 | 0.50 | 0.00, 1.00 |" in text and "| 0/2, 2/2, 2/2 |" in text
    assert "| kvcompress | keydiff | 0.5 | 6 of 6 | 2.50 | nan |  | – | 2/2, 2/2, 2/2 |" in text
    assert text.count("| 'a") == 6  # one row per hit
    margin.write_tables(tmp_path / "none.md", [dict(rows[6])], records)
    assert "finds none of the 1 samples" in (tmp_path / "none.md").read_text()


def test_cells_feed_the_full_cache_answer_through_each_compressed_cache(tiny_run):
    """--cells/--ratios: one row per sample, cell and ratio; where a cell's own greedy answer (the harness record) is the
    full cache's, every step's margin under it is >= 0; KL >= 0; the table pairs each cell with the first; a rerun
    adds nothing; --cells alone and the full cache as a cell are refused."""
    for name in ("margin.jsonl", "margin_cells.jsonl"):
        (tiny_run / name).unlink(missing_ok=True)
    margin.main(["--out", str(tiny_run), "--cells", "knorm,keydiff", "--ratios", "0.5"])
    rows = [json.loads(line) for line in (tiny_run / "margin_cells.jsonl").read_text().splitlines()]
    _, samples = harness.load_samples(tiny_run)
    assert sorted((r["sample"], r["cell"]) for r in rows) == sorted((s["id"], c) for s in samples for c in ("knorm", "keydiff"))
    records = {r["key"]: r for r in harness.read_records(tiny_run)}
    for row in rows:
        full = records[harness.cell_key("kvcompress", "full", None, row["sample"])]
        own = records[harness.cell_key("kvcompress", row["cell"], 0.5, row["sample"])]
        assert row["kl"] >= -1e-6 and len(row["margins"]) == len(full["token_ids"])
        if own["token_ids"] == full["token_ids"]:
            assert min(row["margins"]) >= -1e-4
    table = (tiny_run / "margin_cells.md").read_text()
    assert "| knorm | 0.5 | 2 |" in table and "| keydiff | 0.5 | 2 |" in table and table.count("| – |") == 1
    margin.main(["--out", str(tiny_run), "--cells", "knorm,keydiff", "--ratios", "0.5"])
    assert len((tiny_run / "margin_cells.jsonl").read_text().splitlines()) == len(rows)
    (tiny_run / "margin_cells.jsonl").unlink()
    margin.main(["--out", str(tiny_run), "--cells", "knorm", "--ratios", "0.5", "--sample-indices", str(samples[1]["index"])])
    assert [json.loads(line)["sample"] for line in (tiny_run / "margin_cells.jsonl").read_text().splitlines()] == [samples[1]["id"]]
    for bad in (["--cells", "knorm"], ["--cells", "full,knorm", "--ratios", "0.5"], ["--sample-indices", "7"]):
        with pytest.raises(SystemExit):
            margin.main(["--out", str(tiny_run), *bad])
