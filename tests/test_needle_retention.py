"""benchmarks/needle_retention.py: the needle's token span, and the slots of it a compressed cache holds."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


harness = _load("kvpress_side_by_side")
retention = _load("needle_retention")
# the harness's dump and kvcompress steps on the tiny random model (two filler needles, full and knorm recorded)
from test_kvpress_harness import tiny_run  # noqa: E402,F401


def test_token_span_covers_exactly_the_tokens_of_the_text(tiny_checkpoint):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    ids = tok("Some words first. The special magic number is 4412. Then more words.")["input_ids"]
    span = retention.token_span(tok, ids, "magic number is 4412")
    assert span == list(range(span[0], span[-1] + 1))
    assert "magic number is 4412" in tok.decode(ids[span[0]: span[-1] + 1])
    assert "magic number is 4412" not in tok.decode(ids[span[0] + 1: span[-1] + 1])
    assert "magic number is 4412" not in tok.decode(ids[span[0]: span[-1]])
    with pytest.raises(ValueError, match="do not contain"):
        retention.token_span(tok, ids, "absent text")


@pytest.mark.parametrize("cell", ["knorm", "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05]"])
def test_ratio_zero_keeps_every_needle_slot_and_a_ratio_keeps_its_share(tiny_run, cell):
    (tiny_run / "retention.jsonl").unlink(missing_ok=True)
    retention.main(["--out", str(tiny_run), "--cell", cell, "--ratios", "0,0.5", "--sample-indices", "0,1"])
    rows = [json.loads(line) for line in (tiny_run / "retention.jsonl").read_text().splitlines()]
    assert [(r["index"], r["ratio"]) for r in rows] == [(0, 0.0), (0, 0.5), (1, 0.0), (1, 0.5)]
    records = {r["key"]: r for r in harness.read_records(tiny_run)}
    for r in rows:
        assert r["needle_tokens"] > 0 and len(r["needle_kept_per_layer"]) == 2
        if r["ratio"] == 0:
            assert r["needle_kept"] == r["answer_kept"] == r["context_kept"] == 1.0
        else:
            assert r["context_kept"] == pytest.approx(0.5, abs=0.02)
            assert 0 <= r["needle_kept"] <= 1 and 0 <= r["answer_kept"] <= 1
        record = records.get(harness.cell_key("kvcompress", cell, r["ratio"], r["sample"]), {})
        assert r["prediction"] == record.get("prediction")
        assert r["full_score"] == records[harness.cell_key("kvcompress", "full", None, r["sample"])]["score"]
    assert any(r["prediction"] is not None for r in rows) == (cell == "knorm")
    table = (tiny_run / "retention.md").read_text()
    assert f"## {cell} @ 0.0" in table and f"## {cell} @ 0.5" in table and table.count("\n| 1 | ") == 2
    retention.main(["--out", str(tiny_run), "--cell", cell, "--ratios", "0,0.5", "--sample-indices", "0,1"])  # done: nothing added
    assert len((tiny_run / "retention.jsonl").read_text().splitlines()) == len(rows)


def test_a_cell_that_does_not_compress_a_prefill_is_refused(tiny_run, capsys):
    with pytest.raises(SystemExit) as exited:
        retention.main(["--out", str(tiny_run), "--cell", "full", "--ratios", "0.5", "--sample-indices", "0"])
    assert exited.value.code == 2 and "error: --cell must be a compressing prefill cell" in capsys.readouterr().err
