"""The same sweep run locally, as 2 shards and on a 2-CPU local Ray cluster gives the same
records (timings aside); a Ray worker killed mid-sweep is retried, and a resumed sweep records
every cell exactly once."""

import functools
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from kvcompress.cli import build_parser
from kvcompress.eval import runner
from kvcompress.eval.runner import SweepConfig, run_sweep
from kvcompress.integration import load_model

REPO = Path(__file__).resolve().parent.parent
TIMINGS = {"wall_s", "capture_s", "prefill_s", "compress_s", "decode_s"}
CONFIG = dict(methods=["knorm", "random"], ratios=[0.5], tasks=["niah_single"], lengths=[200], samples=2, max_new_tokens=3)


@pytest.fixture(scope="module")
def ray_cluster():
    """One local 2-CPU Ray cluster for the module; workers import this checkout's kvcompress."""
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def local_records(tiny_checkpoint, tmp_path_factory):
    model, tokenizer = load_model(tiny_checkpoint)
    return run_sweep(model, tokenizer, SweepConfig(**CONFIG), tmp_path_factory.mktemp("local"), progress=False)


def comparable(records):
    return sorted(({k: v for k, v in r.items() if k not in TIMINGS} for r in records), key=lambda r: r["key"])


def recorded_keys(out_dir):
    lines = (Path(out_dir) / runner.RESULTS_FILE).read_text().splitlines()
    return [json.loads(line)["key"] for line in lines if line.strip()]


def test_two_shards_match_the_local_run(tiny_checkpoint, local_records, tmp_path):
    assert len(local_records) == 2 * 3 and all(r["error"] is None for r in local_records)
    model, tokenizer = load_model(tiny_checkpoint)
    first = run_sweep(model, tokenizer, SweepConfig(**CONFIG), tmp_path, progress=False, shard=(0, 2))
    assert {r["index"] for r in first} == {0}  # shard 0 of 2: the first sample with all its cells
    records = run_sweep(model, tokenizer, SweepConfig(**CONFIG), tmp_path, progress=False, shard=(1, 2))
    assert comparable(records) == comparable(local_records)
    assert sorted(recorded_keys(tmp_path)) == sorted(r["key"] for r in local_records)
    with pytest.raises(ValueError, match=r"shard must be \(i, n\) with 0 <= i < n, got \(2, 2\)"):
        run_sweep(model, tokenizer, SweepConfig(**CONFIG), tmp_path, progress=False, shard=(2, 2))
    empty = tmp_path / "empty"
    with pytest.raises(ValueError, match=r"shard 2/4 gets no sample: the sweep has 2 \(give N <= 2\)"):  # it finished with no notice
        run_sweep(model, tokenizer, SweepConfig(**CONFIG), empty, progress=False, shard=(2, 4))
    assert not empty.exists()  # refused before the folder is made
    args = build_parser().parse_args(["eval", "--shard", "1/4"])
    assert args.shard == (1, 4)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--shard", "4/4"])


@pytest.mark.e2e  # slow on 2 cores; `kvcompress eval --ray` runs a sweep on a cluster in every test run (below)
def test_ray_run_matches_the_local_run(ray_cluster, tiny_checkpoint, local_records, tmp_path):
    from kvcompress.eval.ray_sweep import run_sweep_ray

    records, failures = run_sweep_ray(functools.partial(load_model, str(tiny_checkpoint)), SweepConfig(**CONFIG), tmp_path, progress=False)
    assert failures == []
    assert comparable(records) == comparable(local_records)
    assert sorted(recorded_keys(tmp_path)) == sorted(r["key"] for r in local_records)


class KillOnce:
    """A model loader for Ray workers that kills one worker mid-sample (picklable, unlike a closure)."""

    def __init__(self, path, marker):
        self.path, self.marker = str(path), str(marker)

    def __call__(self):
        """The model, with a hook that kills this worker process (SIGKILL) in its first forward pass
        unless `marker` exists, creating it first (so exactly one worker dies)."""
        model, tokenizer = load_model(self.path)

        def kill(module, args):
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                return
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)

        model.register_forward_pre_hook(kill)
        return model, tokenizer


@pytest.mark.e2e  # slow on 2 cores (a cluster, a killed worker, a resumed sweep); `kvcompress eval --ray` is in every test run
def test_killed_worker_is_retried_and_a_resumed_sweep_records_every_cell_once(ray_cluster, tiny_checkpoint, local_records, tmp_path):
    from kvcompress.eval.ray_sweep import run_sweep_ray

    config = SweepConfig(**CONFIG)
    # retried: the killed worker's sample runs again on a fresh worker
    records, failures = run_sweep_ray(KillOnce(tiny_checkpoint, tmp_path / "killed-a"), config, tmp_path / "a", max_retries=1, progress=False)
    assert (tmp_path / "killed-a").exists() and failures == []
    assert comparable(records) == comparable(local_records)
    assert sorted(recorded_keys(tmp_path / "a")) == sorted(r["key"] for r in local_records)
    # no retries: the killed worker's sample stays to do; the resumed sweep does exactly those cells
    records, failures = run_sweep_ray(KillOnce(tiny_checkpoint, tmp_path / "killed-b"), config, tmp_path / "b", max_retries=0, progress=False)
    assert len(failures) == 1 and "WorkerCrashedError" in failures[0]
    assert len(records) == 3 and len(set(recorded_keys(tmp_path / "b"))) == 3
    records, failures = run_sweep_ray(KillOnce(tiny_checkpoint, tmp_path / "killed-b"), config, tmp_path / "b", max_retries=0, progress=False)
    assert failures == []
    keys = recorded_keys(tmp_path / "b")
    assert sorted(keys) == sorted(r["key"] for r in local_records)  # every cell, exactly once
    assert comparable(records) == comparable(local_records)


def test_a_failed_ray_task_is_reported_by_the_error_it_raised():
    """A task's own error was shown as Ray's coloured banner line ("RayTaskError(KeyError): \\x1b[36mray::_sample_task()...")
    and said "failed after 3 retries", though Ray retries crashed workers only."""
    from kvcompress.eval.ray_sweep import failure_reason

    class TaskError(Exception):
        def __init__(self, cause):
            super().__init__("\x1b[36mray::_sample_task()\x1b[39m (pid=1, ip=x)\n  File ...\nKeyError: 'boom'")
            self.cause = cause

    assert failure_reason(TaskError(KeyError("boom"))) == "KeyError: 'boom'"
    assert failure_reason(TaskError(None)) == "TaskError: ray::_sample_task() (pid=1, ip=x)"


def test_results_file_never_records_a_cell_twice(tmp_path):
    path = tmp_path / runner.RESULTS_FILE
    first, second = runner.ResultsFile(path), runner.ResultsFile(path)
    assert first.write([{"key": "a"}, {"key": "b"}]) == 2
    assert second.write([{"key": "b"}, {"key": "c"}]) == 1  # sees what the other writer appended
    with path.open("a") as f:
        f.write('{"key": "torn')
    assert [r["key"] for r in runner.read_results(path)] == ["a", "b", "c"]  # a torn last line: resumable
    assert first.write([{"key": "a"}, {"key": "d"}]) == 1
    assert [r["key"] for r in runner.read_results(path)] == ["a", "b", "c", "d"]
    assert b"torn" not in path.read_bytes()  # cut off before the next record



def test_results_file_refuses_a_second_prompt_of_a_sample_in_one_batch_and_after_its_own_write(tmp_path):
    """A sample's cells pair only on one prompt (`prompt_sha256`): a batch holding two, or a record whose sample this
    writer wrote from another prompt, is refused, writing nothing; a method name holding '|' does not hide the sample."""
    path = tmp_path / runner.RESULTS_FILE

    def record(method, digest):
        return {"key": f"task|t|200|0|0.5|{method}|0.5|prefill", "method": method, "ratio": 0.5, "mode": "prefill", "prompt_sha256": digest}

    writer = runner.ResultsFile(path)
    with pytest.raises(ValueError, match=r"holds sample 'task\|t\|200\|0\|0\.5' answered from another prompt"):
        writer.write([record("a", "1" * 64), record("b|c", "2" * 64)])
    assert runner.read_results(path) == []
    assert writer.write([record("a", "1" * 64)]) == 1
    with pytest.raises(ValueError, match=r"holds sample 'task\|t\|200\|0\|0\.5' answered from another prompt"):
        writer.write([record("b|c", "2" * 64)])
    assert writer.write([record("b|c", "1" * 64), {"key": "no digest"}]) == 2

def test_results_file_refuses_a_corrupt_line_before_the_last_naming_it(tmp_path):
    path = tmp_path / runner.RESULTS_FILE
    path.write_text('{"key": "a"}\n{"key": oops}\n{"key": "c"}\n')
    with pytest.raises(ValueError, match=r"line 2 is not a JSON record"):
        runner.read_results(path)
    with pytest.raises(ValueError, match=r"line 2 is not a JSON record"):
        runner.ResultsFile(path).write([{"key": "d"}])
    assert path.read_text().count("\n") == 3  # nothing written


def test_cli_runs_a_benchmark_on_ray(ray_cluster, tiny_checkpoint, tmp_path, capsys):
    from kvcompress.cli import main

    fixtures = REPO / "tests" / "fixtures" / "ruler"
    args = ["eval", "--benchmark", "ruler", "--data", str(fixtures), "--model", str(tiny_checkpoint), "--methods", "knorm",
            "--ratios", "0.2", "--max-new-tokens", "2", "--ray", "--out", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    records = runner.read_results(tmp_path / runner.RESULTS_FILE)
    assert len(records) == 3 * 2 and all(r["error"] is None and r["benchmark"] == "ruler" for r in records)
    assert "| method @ ratio | average | niah_single_1 | qa_1 |" in capsys.readouterr().out
    assert (tmp_path / "leaderboard_ruler.html").is_file()
    assert main(args + ["--shard", "0/2"]) == 2  # Ray distributes the samples itself
    assert "--shard and --ray" in capsys.readouterr().err
