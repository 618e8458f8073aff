"""Every subcommand, fed missing files, bad numbers, unknown names and conflicting flags: exit status 2 and one clear line on stderr, never a traceback.

All cases fail before a model is loaded, so the test needs no model and runs in seconds.
"""

import json
from pathlib import Path

import pytest

from kvcompress.calibration import Calibration
from kvcompress.cli import main

REPO = Path(__file__).resolve().parents[1]

@pytest.fixture
def context_file(tmp_path):
    path = tmp_path / "context.txt"
    path.write_text("The magic number is 42. " * 20)
    path.with_name("not-json.json").write_text("alpha=1\n")
    path.with_name("empty.jsonl").write_text("")
    path.with_name("not-calibration.json").write_text(json.dumps({"method": "knorm", "alpha": 1.0}))
    Calibration("keydiff", alpha=1.0, beta=-2.0, method_params={"anchor": "mean"}).save(path.with_name("keydiff.json"))
    return path


GEN = ["generate", "--context-file", "{ctx}"]
CALIBRATED = [*GEN, "--calibration", "{tmp}/keydiff.json", "--quality", "0.9"]
BENCH = ["bench", "--out", "{tmp}/bench", "--sections", "overhead", "--repeats", "1"]
CAL = ["calibrate", "--out", "{tmp}/cal.json"]

# name: (argv with {tmp} = a fresh directory and {ctx} = a readable context file, text the error line must contain)
CASES = {
    # generate
    "generate missing context file": (["generate", "--context-file", "{tmp}/none.txt", "--budget", "8"], "--context-file"),
    "generate context file is a directory": (["generate", "--context-file", "{tmp}", "--budget", "8"], "is a directory: pass a text file"),
    "generate boolean parameter not a boolean": ([*GEN, "--method", "random", "--budget", "8", "--param", "weighted=no"],
                                                 "weighted must be True or False (on the command line: true or false)"),
    "generate missing model directory": ([*GEN, "--budget", "8", "--model", "{tmp}/no-model"],
                                          "--model '{tmp}/no-model': path must be a local checkpoint directory"),
    "generate model that is a text file": ([*GEN, "--budget", "8", "--model", "{ctx}"], "--model '{ctx}': path must be a local checkpoint"),
    "generate model folder without a config's model type": ([*GEN, "--budget", "8", "--model", "{tmp}"], "--model '{tmp}': "),
    "generate cache that is not a cache file": (["generate", "--cache", "{ctx}"], "--cache '{ctx}': "),
    "generate no context file flag": (["generate", "--budget", "8"], "--context-file"),
    "generate budget not a number": ([*GEN, "--budget", "many"], "--budget"),
    "generate budget zero": ([*GEN, "--budget", "0"], "budget"),
    "generate ratio one": ([*GEN, "--compression-ratio", "1.0"], "--compression-ratio must be in [0, 1)"),
    "generate ratio nan": ([*GEN, "--compression-ratio", "nan"], "--compression-ratio must be in [0, 1)"),
    "generate negative sink": ([*GEN, "--budget", "8", "--sink", "-1"], "sink"),
    "generate zero new tokens": ([*GEN, "--budget", "8", "--max-new-tokens", "0"], "--max-new-tokens"),
    "generate zero chunk size": ([*GEN, "--budget", "8", "--chunk-size", "0"], "--chunk-size"),
    "generate full cache with slack": ([*GEN, "--method", "full", "--slack", "0.5"], "--slack"),
    "generate negative slack": ([*GEN, "--budget", "8", "--mode", "chunked", "--slack", "-1"], "slack"),
    "generate slack in prefill mode": ([*GEN, "--budget", "8", "--slack", "0.5"], "slack"),
    "generate unknown method": ([*GEN, "--method", "zip", "--budget", "8"], "argument --method: unknown method 'zip'; known methods: full, default, kvzip_refit, adakv, balancekv"),
    "generate unknown mode": ([*GEN, "--budget", "8", "--mode", "fast"], "--mode"),
    "generate unknown method parameter": ([*GEN, "--method", "keydiff", "--budget", "8", "--param", "bogus=1"], "bogus"),
    "generate malformed parameter": ([*GEN, "--budget", "8", "--param", "anchor"], "--param"),
    "generate budget and ratio": ([*GEN, "--budget", "8", "--compression-ratio", "0.5"], "not allowed with"),
    "generate neither budget nor ratio": (GEN, "pass --compression-ratio, --budget or --calibration with --quality"),
    "generate full with a budget": ([*GEN, "--method", "full", "--budget", "8"], "--method full"),
    "generate full with a sink": ([*GEN, "--method", "full", "--sink", "0"], "it takes no --sink"),
    "generate zero threads": ([*GEN, "--budget", "8", "--threads", "0"], "argument --threads: expected an integer >= 1, got '0'"),
    "generate threads not a number": ([*GEN, "--budget", "8", "--threads", "all"], "--threads"),
    "generate calibration file missing": ([*GEN, "--calibration", "{tmp}/none.json", "--quality", "0.9"], "none.json' does not exist: write one with"),
    "generate calibration file is a directory": ([*GEN, "--calibration", "{tmp}", "--quality", "0.9"], "is a directory"),
    "generate calibration file not JSON": ([*GEN, "--calibration", "{tmp}/not-json.json", "--quality", "0.9"], "is not JSON text"),
    "generate calibration file without beta": ([*GEN, "--calibration", "{tmp}/not-calibration.json", "--quality", "0.9"],
                                               "not a calibration file (missing ['beta']"),
    "generate calibration without quality": ([*GEN, "--calibration", "{tmp}/keydiff.json"], "needs --quality"),
    "generate quality without calibration": ([*GEN, "--quality", "0.9"], "--quality 0.9 goes with --calibration"),
    "generate quality with a budget": ([*GEN, "--budget", "8", "--quality", "0.9"], "--quality 0.9 goes with --calibration"),
    "generate quality above one": ([*GEN, "--calibration", "{tmp}/keydiff.json", "--quality", "1.5"], "quality (the NLL-ratio budget gamma) must be in (0, 1], got 1.5"),
    "generate calibration and budget": ([*CALIBRATED, "--budget", "8"], "argument --budget: not allowed with argument --calibration"),
    "generate calibration and ratio": ([*CALIBRATED, "--compression-ratio", "0.5"], "not allowed with argument --calibration"),
    "generate calibration of another method": ([*CALIBRATED, "--method", "snapkv"], "--calibration was fitted for method 'keydiff', got --method snapkv"),
    "generate calibration and full cache": ([*CALIBRATED, "--method", "full"], "--method full keeps every token: it takes no --calibration, --quality"),
    "generate parameter unlike the calibration's": ([*CALIBRATED, "--param", "anchor=median"], "method parameters {'anchor': 'median'} differ from those the calibration"),
    # demo
    "demo unknown method": (["demo", "--methods", "zip"], "argument --methods: unknown method(s) ['zip']"),
    "demo comma-separated methods, one unknown": (["demo", "--methods", "keydiff,zip"], "unknown method(s) ['zip']"),
    "demo ratio not a number": (["demo", "--compression-ratio", "half"], "--compression-ratio"),
    "eval kind twice": (["eval", "--tasks", "niah_single", "--kind", "words", "--task-param", "niah_single.kind=numbers"],
                        "--kind words and --task-param niah_single.kind=numbers set the same thing: give one"),
    "demo negative seed": (["demo", "--seed", "-1"], "argument --seed: expected an integer from 0 to 2**63 - 1, got '-1'"),
    "demo ratio one": (["demo", "--compression-ratio", "1"], "compression-ratio"),
    "demo depth above one": (["demo", "--depth", "1.5"], "depth"),
    "demo missing model directory": (["demo", "--model", "{tmp}/no-model", "--tokens", "64"], "checkpoint"),
    # eval
    "eval unknown method": (["eval", "--methods", "zip", "--out", "{tmp}/e"], "argument --methods: unknown method(s) ['zip']"),
    "eval unknown mode": (["eval", "--modes", "fast", "--out", "{tmp}/e"], "argument --modes: unknown mode(s) ['fast']; known modes: prefill"),
    "eval unknown task": (["eval", "--tasks", "haystack", "--out", "{tmp}/e"], "haystack"),
    "eval unknown bench": (["eval", "speed"], "speed"),
    "eval ratio out of range": (["eval", "--ratios", "0.5,1.5", "--out", "{tmp}/e"], "1.5"),
    "eval ratios not numbers": (["eval", "--ratios", "half"], "--ratios"),
    "eval zero samples": (["eval", "--samples", "0", "--out", "{tmp}/e"], "samples"),
    "eval zero threads": (["eval", "--threads", "0"], "argument --threads: expected an integer >= 1, got '0'"),
    "eval zero chunk size": (["eval", "--modes", "chunked", "--chunk-size", "0", "--out", "{tmp}/e"],
                             "argument --chunk-size: expected an integer >= 1, got '0'"),
    "eval negative seed": (["eval", "--seed", "-1", "--out", "{tmp}/e"], "argument --seed: expected an integer from 0 to 2**63 - 1, got '-1'"),
    "generate seed past 63 bits": ([*GEN, "--seed", str(2**63)], f"argument --seed: expected an integer from 0 to 2**63 - 1, got '{2**63}'"),
    "bench seed not an integer": (["bench", "--seed", "1.5"], "argument --seed: expected an integer from 0 to 2**63 - 1, got '1.5'"),
    "calibrate negative seed": (["calibrate", "--out", "{tmp}/c.json", "--seed", "-3"], "argument --seed: expected an integer from 0"),
    "train-scorer seed past 64 bits": (["train-scorer", "--out", "{tmp}/s.safetensors", "--seed", str(2**64)],
                                       "argument --seed: expected an integer from 0 to 2**63 - 1"),
    "eval zero answer tokens": (["eval", "--max-new-tokens", "0", "--out", "{tmp}/e"], "argument --max-new-tokens: expected an integer >= 1"),
    "eval grid lengths without depths": (["eval", "--grid-lengths", "1024", "--out", "{tmp}/e"], "--grid-lengths and --grid-depths set the needle heat map together: give both"),
    "eval malformed task parameter": (["eval", "--task-param", "n_keys=4", "--out", "{tmp}/e"], "--task-param"),
    "eval approx sink beyond tokens": (["eval", "approx", "--tokens", "100", "--sink", "256"], "tokens"),
    "eval approx with sweep flags": (["eval", "approx", "--tasks", "niah_single", "--chunk-size", "64"],
                                     "`eval approx` takes none of the task sweep's and perplexity's flags; got --tasks, --chunk-size"),
    "eval sweep with approx flags": (["eval", "--layers", "3", "--queries", "5", "--out", "{tmp}/e"],
                                     "the task sweep and perplexity take none of `eval approx`'s flags; got --layers, --queries"),
    "eval missing model directory": (["eval", "--model", "{tmp}/no-model", "--out", "{tmp}/e"], "checkpoint"),
    "eval perplexity with other tasks": (["eval", "--tasks", "perplexity,niah_single", "--out", "{tmp}/e"], "runs alone"),
    "eval perplexity unknown method": (["eval", "--tasks", "perplexity", "--methods", "zip", "--out", "{tmp}/e"], "zip"),
    "eval perplexity documents too short": (["eval", "--tasks", "perplexity", "--lengths", "10", "--out", "{tmp}/e"], "lengths"),
    "eval perplexity context fraction one": (["eval", "--tasks", "perplexity", "--context-fraction", "1", "--out", "{tmp}/e"], "--context-fraction must be a number in (0, 1)"),
    "eval perplexity zero documents": (["eval", "--tasks", "perplexity", "--samples", "0", "--out", "{tmp}/e"], "--samples"),
    "eval perplexity zero block": (["eval", "--tasks", "perplexity", "--block", "0", "--out", "{tmp}/e"], "block"),
    "eval perplexity with a haystack": (["eval", "--tasks", "perplexity", "--haystack", "prose", "--out", "{tmp}/e"], "--haystack"),
    "eval haystack no task takes": (["eval", "--tasks", "niah_prose", "--haystack", "prose", "--out", "{tmp}/e"],
                                    "--haystack prose applies to the tasks niah_single"),
    "eval kind no task takes": (["eval", "--tasks", "niah_prose,line_retrieval", "--kind", "words", "--out", "{tmp}/e"],
                                "none of them is run (tasks niah_prose, line_retrieval)"),
    "eval context fraction without perplexity": (["eval", "--context-fraction", "0.5", "--out", "{tmp}/e"], "--context-fraction"),
    # bench
    "bench unknown section": (["bench", "--sections", "speed", "--out", "{tmp}/b"], "argument --sections: unknown section(s) ['speed']"),
    "bench unknown method": ([*BENCH, "--methods", "zip"], "argument --methods: unknown method(s) ['zip']"),
    "bench unknown memory method": ([*BENCH, "--memory-method", "zip"], "argument --memory-method: unknown method 'zip'"),
    "bench unknown shape": ([*BENCH, "--methods", "knorm", "--sizes", "32", "--shapes", "gpt"], "argument --shapes: unknown shape(s) ['gpt']"),
    "bench unknown step shape": ([*BENCH, "--step-shape", "gpt"], "argument --step-shape: unknown shape 'gpt'; known shapes: smollm2, llama8b"),
    "bench zero repeats": (["bench", "--out", "{tmp}/bench", "--sections", "overhead", "--methods", "knorm", "--sizes", "32", "--repeats", "0"],
                           "repeats must be an integer >= 1, got 0"),
    "bench kept above one": (["bench", "--out", "{tmp}/bench", "--sections", "decode", "--kept", "0.5,2"],
                             "kept must hold fractions of the context kept, in (0, 1], got [2.0]"),
    "bench repeated thread counts": ([*BENCH, "--methods", "knorm", "--sizes", "32", "--threads", "1,1"], "threads must not repeat a value"),
    "bench repeated sizes": ([*BENCH, "--methods", "knorm", "--sizes", "32,32,64"], "--sizes must not repeat a value, got 32 more than once in [32, 32, 64]"),
    "bench repeated methods": ([*BENCH, "--methods", "knorm,knorm", "--sizes", "32"], "--methods must not repeat a value, got 'knorm' more than once"),
    "calibrate infinite asymmetry": ([*CAL, "--asymmetry", "inf"], "--asymmetry must be a number from 1 to 1e+06 (the weight of residuals where the curve promises more quality than measured), got inf"),
    "calibrate huge asymmetry": ([*CAL, "--asymmetry", "1e308"], "--asymmetry must be a number from 1 to 1e+06"),
    "eval perplexity with a prompt layout": (["eval", "--tasks", "perplexity", "--prompt-layout", "newline", "--out", "{tmp}/p"],
                                             "--prompt-layout do not apply to --tasks perplexity"),
    "eval perplexity with the grid task at its default": (["eval", "--tasks", "perplexity", "--grid-task", "niah_single", "--out", "{tmp}/p"],
                                                          "--grid-task do not apply to --tasks perplexity"),
    "eval grid ratios without grid lengths": (["eval", "--tasks", "niah_single", "--grid-ratios", "0.5", "--out", "{tmp}/e"],
                                              "--grid-ratios set the needle heat map, which --grid-lengths asks for"),
    "bench sizes not numbers": ([*BENCH, "--sizes", "1k"], "--sizes"),
    "bench size too small": ([*BENCH, "--sizes", "1"], "sizes"),
    "bench zero threads": ([*BENCH, "--methods", "knorm", "--sizes", "32", "--threads", "0"], "argument --threads: expected comma-separated integers >= 1"),
    "bench ratio one": ([*BENCH, "--methods", "knorm", "--sizes", "32", "--compression-ratio", "1"], "--compression-ratio must be in [0, 1)"),
    "bench unknown dtype": ([*BENCH, "--methods", "knorm", "--sizes", "32", "--dtype", "float8"], "--dtype"),
    "bench unknown device": ([*BENCH, "--methods", "knorm", "--sizes", "32", "--device", "tpu"], "--device"),
    "bench report without csvs": (["bench", "--report-only", "--out", "{tmp}/empty"], "no bench CSV"),
    "bench flag of a section not run": (["bench", "--sections", "overhead", "--kept", "0.5", "--step-repeats", "2", "--out", "{tmp}/b"],
                                        "--kept, --step-repeats set sections not run (--sections overhead)"),
    "bench report-only with measurement flags": (["bench", "--report-only", "--out", "{tmp}/b", "--sizes", "64"], "--report-only"),
    # calibrate
    "calibrate missing out flag": (["calibrate"], "--out"),
    "calibrate out directory missing": (["calibrate", "--out", "{tmp}/no/cal.json"], "--out"),
    "calibrate unknown method": ([*CAL, "--method", "zip"], "argument --method: unknown method 'zip'"),
    "calibrate unknown task": ([*CAL, "--tasks", "haystack"], "argument --tasks: unknown task(s) ['haystack']; known tasks: niah_single"),
    "calibrate too few tokens": ([*CAL, "--tokens", "8"], "argument --tokens: expected an integer >= 64, got '8'"),
    "calibrate a method scored by hidden states": ([*CAL, "--method", "kvzap"], "method 'kvzap' scores the context with the layers' hidden states"),
    "calibrate a method scored by reconstruction": ([*CAL, "--method", "kvzip"], "method 'kvzip' scores the context with its reconstruction forward"),
    "calibrate retention above one": ([*CAL, "--retentions", "0.5,2"], "--retentions"),
    "calibrate retentions not numbers": ([*CAL, "--retentions", "most"], "--retentions"),
    "calibrate a retention twice": ([*CAL, "--retentions", "0.5,0.5"], "--retentions must be different fractions, got [0.5] more than once"),
    "calibrate zero samples": ([*CAL, "--samples", "0"], "argument --samples: expected an integer >= 1, got '0'"),
    "calibrate asymmetry below one": ([*CAL, "--asymmetry", "0.5"], "--asymmetry"),
    "calibrate one measurement": ([*CAL, "--tasks", "niah_single", "--samples", "1", "--retentions", "0.5"],
                                  "the fit needs at least 2 measurements: --tasks (1) x --samples (1) x --retentions (1) give 1"),
    "calibrate triples and out the same file": ([*CAL, "--triples", "{tmp}/cal.json"], "--triples"),
    "calibrate missing model directory": ([*CAL, "--model", "{tmp}/no-model"], "checkpoint"),
    # the command itself
    "unknown subcommand": (["bogus"], "argument command: invalid choice: 'bogus'"),
    "compress without its required flags": (["compress"], "the following arguments are required: --context-file, --out"),
    "unknown flag": ([*GEN, "--budget", "8", "--temperature", "0.5"], "--temperature"),
    # a flag the subcommand lacks is its error, not the top-level command's
    "demo unknown flag": (["demo", "--temperature", "1"], "kvcompress demo: error: unrecognized arguments: --temperature 1"),
    "demo zero threads": (["demo", "--threads", "0"], "kvcompress demo: error: argument --threads"),
    "demo short context": (["demo", "--tokens", "10"], "kvcompress demo: error: --tokens (the context's length) must be >= 64, got 10"),
    "calibrate zero threads": ([*CAL, "--threads", "0"], "kvcompress calibrate: error: argument --threads"),
    "compress question flag": (["compress", "--context-file", "{ctx}", "--out", "{tmp}/c.kvc", "--budget", "8", "--compress-question"],
                               "kvcompress compress: error: unrecognized arguments: --compress-question"),
    "compress out folder missing": (["compress", "--context-file", "{ctx}", "--out", "{tmp}/no/c.kvc", "--budget", "8"],
                                    "--out '{tmp}/no/c.kvc': directory '{tmp}/no' does not exist"),
    "compress empty out": (["compress", "--context-file", "{ctx}", "--out", "", "--budget", "8"], "argument --out: takes a path, got ''"),
    "compress out is a folder": (["compress", "--context-file", "{ctx}", "--out", "{tmp}", "--budget", "8"],
                                 "--out '{tmp}' is a directory; give the path of the file to write"),
    "calibrate out is a folder": (["calibrate", "--out", "{tmp}"], "--out '{tmp}' is a directory"),
    "train-scorer out is a folder": (["train-scorer", "--out", "{tmp}"], "--out '{tmp}' is a directory"),
    "train-scorer linear with mlp flags": (["train-scorer", "--steps", "10", "--out", "{tmp}/s.safetensors"],
                                           "--steps sets the MLP of --kind mlp; --kind linear (ridge regression) takes neither --mlp-width nor --steps"),
    "bench kept for attention with methods": (["bench", "--sections", "attention", "--kept", "0.5", "--methods", "keydiff", "--out", "{tmp}/b"],
                                              "--methods set sections not run (--sections attention)"),
    "bench model for the synthetic sections": (["bench", "--sections", "overhead", "--model", "{tmp}/no-model", "--out", "{tmp}/b"],
                                               "--model set sections not run (--sections overhead)"),
    "bench seed for prefill": (["bench", "--sections", "prefill", "--seed", "7", "--out", "{tmp}/b"], "--seed set sections not run (--sections prefill)"),
    "bench chunk size with prefill memory": (["bench", "--sections", "memory", "--memory-modes", "prefill", "--chunk-size", "32", "--out", "{tmp}/b"],
                                             "--chunk-size sets the blocks of a streaming mode; --memory-modes prefill streams nothing"),
    "bench prefill ratio a short context cannot honour": (["bench", "--sections", "prefill,throughput", "--methods", "keydiff,snapkv",
                                                           "--prefill-tokens", "128", "--out", "{tmp}/b"],
                                                          "--prefill-ratio 0.75 cannot be honoured by 'snapkv' in a context of --prefill-tokens 128"),
    "bench kernel repeats without a mass method": (["bench", "--sections", "prefill", "--methods", "keydiff", "--kernel-repeats", "9",
                                                    "--out", "{tmp}/b"], "--kernel-repeats times the attention-mass kernel of a method that needs it"),
    "bench block with no stream timed": (["bench", "--sections", "overhead", "--stream", "none", "--block", "7", "--out", "{tmp}/b"],
                                         "--block sets the stream updates' size; --stream none times no stream"),
    "bench out is a file": (["bench", "--sections", "overhead", "--out", "{ctx}"], "argument --out: "),
    "generate meta device": ([*GEN, "--budget", "8", "--device", "meta"], "--device: device must be 'cpu' or a CUDA device"),
    "generate mps device": ([*GEN, "--budget", "8", "--device", "mps"], "--device: device must be 'cpu' or a CUDA device"),
    "generate two questions, each compressed": ([*GEN, "--budget", "8", "--question", "One?", "--question", "Another?", "--compress-question"],
                                                "--compress-question compresses one question with its context, and several --question flags "
                                                "share one compressed context"),
    # it said "--question must be a non-empty str, or None for no question": None is no command-line value
    "generate empty question": ([*GEN, "--budget", "8", "--question", ""], "argument --question: expected a question, got ''; leave --question out to ask none"),
    "generate blank question": ([*GEN, "--budget", "8", "--question", " \n"], "argument --question: expected a question, got ' \\n'; leave --question out"),
    "generate param twice": ([*GEN, "--method", "snapkv", "--budget", "8", "--param", "kernel_size=3", "--param", "kernel_size=5"],
                             "'kernel_size' is given more than once"),
    "generate compress question in decode mode": ([*GEN, "--budget", "8", "--mode", "decode", "--compress-question"],
                                                  "--compress-question changes nothing in --mode decode"),
    # a flag is refused when given, whatever its value: its default included
    "generate cache with flags at their defaults": (["generate", "--cache", "{tmp}/c.kvc", "--question", "Q?", "--mode", "prefill", "--seed", "0",
                                                     "--chunk-size", "256"], "it takes no --mode, --seed, --chunk-size"),
    "generate chunk size in prefill mode": ([*GEN, "--budget", "8", "--chunk-size", "256"],
                                            "--chunk-size 256 is the prompt's block size in --mode chunked or decode"),
    "generate abbreviated flag": ([*GEN, "--budget", "8", "--max-new", "4"], "unrecognized arguments: --max-new 4"),
    "compress full cache": (["compress", "--context-file", "{ctx}", "--out", "{tmp}/c.kvc", "--method", "full"],
                            "argument --method: unknown method 'full'"),
    "eval approx with a sweep flag at its default": (["eval", "approx", "--out", "{tmp}/o", "--samples", "1"],
                                                     "`eval approx` takes none of the task sweep's and perplexity's flags; got --samples"),
    "eval unknown task": (["eval", "--tasks", "bogus", "--out", "{tmp}/o"], "--tasks: unknown task(s) ['bogus']; known tasks: niah_single"),
    "eval full with another method": (["eval", "--methods", "full,knorm", "--out", "{tmp}/o"], "--methods full runs the task sweep's full-cache cells alone"),
    "eval full without the full cache": (["eval", "--methods", "full", "--no-full", "--out", "{tmp}/o"], "got --methods full with --no-full"),
    "eval empty out": (["eval", "--out", "", "--methods", "knorm"], "argument --out: takes a folder's path, got ''"),
    "eval out is a file": (["eval", "--out", "{ctx}", "--methods", "knorm"], "argument --out: '{ctx}' is a file; give a folder"),
    "eval chunk size with prefill only": (["eval", "--methods", "knorm", "--chunk-size", "64", "--out", "{tmp}/o"],
                                          "--chunk-size 64 is the prompt's block size in --modes chunked or decode; this run has "
                                          "--modes prefill only"),
    "perplexity chunk size with prefill only": (["eval", "--tasks", "perplexity", "--modes", "prefill", "--methods", "knorm",
                                                 "--chunk-size", "64", "--out", "{tmp}/o"], "--chunk-size 64 is the prompt's block size"),
    "eval task parameter of a task not run": (["eval", "--tasks", "niah_single", "--task-param", "niah_multikey.n_keys=4", "--methods",
                                               "knorm", "--out", "{tmp}/o"],
                                              "--task-param names task(s) ['niah_multikey'] this run does not run (its tasks: niah_single)"),
    "compress out under a file": (["compress", "--context-file", "{ctx}", "--out", "{ctx}/c.kvc", "--budget", "8"],
                                  "--out '{ctx}/c.kvc': '{ctx}' is a file, not a directory"),
    "eval full with ratios": (["eval", "--methods", "full", "--ratios", "0.5", "--out", "{tmp}/o"], "got --methods full with --ratios"),
    "eval ray cpus at the default without ray": (["eval", "--ray-cpus", "1", "--out", "{tmp}/o"], "--ray-cpus and --ray-retries go with --ray"),
    "eval out under a file": (["eval", "--tasks", "niah_single", "--methods", "knorm", "--out", "{ctx}/sweep"],
                              "--out '{ctx}/sweep': the folder cannot be created (Not a directory)"),
    "bench out under a file": (["bench", "--out", "{ctx}/bench", "--sections", "overhead", "--repeats", "1"],
                               "--out '{ctx}/bench': the folder cannot be created (Not a directory)"),
    "bench report of an empty folder": (["bench", "--report-only", "--out", "{tmp}"], "--out: the folder '{tmp}' holds no bench CSV"),
    "eval benchmark data file empty": (["eval", "--benchmark", "longbench", "--data", "{tmp}/empty.jsonl", "--out", "{tmp}/o"],
                                       "--data file '{tmp}/empty.jsonl' is empty"),
    "eval benchmark task not in the data": (["eval", "--benchmark", "longbench", "--data", str(REPO / "tests" / "fixtures" / "longbench"),
                                             "--tasks", "nosuch", "--out", "{tmp}/o"],
                                            "have no samples in '" + str(REPO / "tests" / "fixtures" / "longbench")
                                            + "' (longbench); its tasks: hotpotqa, multifieldqa_zh, passage_retrieval_en, trec"),
    "eval grid depth above one": (["eval", "--tasks", "niah_single", "--grid-lengths", "256", "--grid-depths", "1.5", "--out", "{tmp}/o"],
                                  "--grid-depths must lie in [0, 1], got 1.5"),
    "eval a ratio twice": (["eval", "--methods", "knorm", "--ratios", "0.5,0.75,0.5", "--out", "{tmp}/o"],
                           "--ratios must not repeat a value, got 0.5 more than once in [0.5, 0.75, 0.5]"),
    "eval a method twice": (["eval", "--methods", "knorm,snapkv,knorm", "--out", "{tmp}/o"], "--methods must not repeat a value, got 'knorm'"),
    "eval a grid depth twice": (["eval", "--tasks", "niah_single", "--grid-lengths", "256", "--grid-depths", "0.5,0.5", "--out", "{tmp}/o"],
                                "--grid-depths must not repeat a value"),
    "perplexity a length twice": (["eval", "--tasks", "perplexity", "--lengths", "256,256", "--out", "{tmp}/p"],
                                  "--lengths must not repeat a value, got 256 more than once"),
    "approx a layer twice": (["eval", "approx", "--layers", "1,1", "--out", "{tmp}/a"], "--layers must not repeat a value, got 1 more than once"),
    "eval a shard with no sample": (["eval", "--tasks", "niah_single", "--samples", "1", "--lengths", "256", "--methods", "knorm",
                                     "--shard", "1/2", "--out", "{tmp}/o"], "--shard 1/2 gets no sample: the sweep has 1 (give N <= 1)"),
    "perplexity a shard with no document": (["eval", "--tasks", "perplexity", "--samples", "1", "--lengths", "256", "--methods", "knorm",
                                             "--shard", "3/4", "--out", "{tmp}/o"], "--shard 3/4 gets no sample: the sweep has 1"),
    "eval shard with a sign": (["eval", "--shard", "0/+2", "--out", "{tmp}/o"], "argument --shard: --shard takes I/N with 0 <= I < N, got '0/+2'"),
    "eval shard with a space": (["eval", "--shard", " 0/2", "--out", "{tmp}/o"], "--shard takes I/N"),
    "eval ray with a shard": (["eval", "--ray", "--shard", "0/2", "--out", "{tmp}/o"], "--shard and --ray exclude each other"),
    "generate full cache with a seed": ([*GEN, "--method", "full", "--seed", "5"], "--method full keeps every token: it takes no --seed"),
    "generate full cache compressing the question": ([*GEN, "--method", "full", "--compress-question"],
                                                      "--method full keeps every token: it takes no --compress-question"),
    "generate balancekv delta at the default step": ([*GEN, "--method", "balancekv", "--budget", "8", "--param", "delta=0.3"],
                                                     "delta=0.3 is the failure probability of the theoretical gain that step=None uses"),
    "no subcommand": ([], "command"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_command_lines_exit_2_with_one_line(name, tmp_path, context_file, capsys):
    template, expected = CASES[name]
    argv = [arg.format(tmp=tmp_path, ctx=context_file) for arg in template]
    expected = expected.replace("{tmp}", str(tmp_path)).replace("{ctx}", str(context_file))
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert status == 2, captured.err
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err and expected in lines[0]
    assert lines[0].startswith("kvcompress")


def test_a_context_file_that_is_not_utf8_names_the_flag_the_file_and_a_fix(tmp_path, capsys):
    path = tmp_path / "latin1.txt"
    path.write_bytes("Caf\xe9 au lait. ".encode("latin-1") * 10)
    assert main(["generate", "--context-file", str(path), "--budget", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--context-file" in err[0] and "latin1.txt" in err[0] and "not UTF-8" in err[0] and "iconv" in err[0]
    assert "iconv -f latin1 -t utf-8" in err[0]
    # a UTF-16 or UTF-32 file (a Windows editor's "Unicode") was advised the Latin-1 conversion, which garbles it
    for encoding, mark in [("utf-16", "UTF-16"), ("utf-16-be", None), ("utf-32", "UTF-32")]:
        path = tmp_path / f"{encoding}.txt"
        path.write_bytes(("\ufeff" if mark is None else "").encode(encoding) + "Caf\xe9 au lait. ".encode(encoding) * 10)
        assert main(["generate", "--context-file", str(path), "--budget", "8"]) == 2
        err = capsys.readouterr().err.strip()
        assert f"it starts with a {mark or 'UTF-16'} byte-order mark); convert it first, e.g. iconv -f {(mark or 'utf-16').lower()} -t utf-8" in err


def test_a_context_file_is_read_without_its_byte_order_mark_and_an_empty_one_is_refused(tmp_path, capsys):
    """A UTF-8 file saved with a byte-order mark gives the same context as without it; an empty or white-space file is
    refused naming --context-file and the file, before the model loads."""
    from kvcompress.commands.generate import read_context

    text = "The magic number is 42. Grass is green."
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert read_context(tmp_path / "bom.txt") == text
    for name, content in (("empty.txt", ""), ("blank.txt", " \n\t\n")):
        (tmp_path / name).write_text(content)
        for command in (["generate", "--budget", "8"], ["compress", "--budget", "8", "--out", str(tmp_path / "c.kvc")]):
            assert main([*command, "--context-file", str(tmp_path / name)]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and f"--context-file {str(tmp_path / name)!r} is empty" in err[0], err


def test_a_context_piped_to_standard_input_is_the_file_s_context(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """`--context-file -` reads the context from standard input (generate and compress): the same answer and the same
    saved cache as the file; empty or non-UTF-8 input is refused naming standard input, before the model loads."""
    import io

    text = "w1 w2 w3 w4 w5 w6 w7 w8 w9 " * 20 + "\r\n"
    (tmp_path / "doc.txt").write_bytes(text.encode())

    def piped(data: bytes):
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data)))

    flags = ["--model", str(tiny_checkpoint), "--method", "knorm", "--budget", "8", "--sink", "2", "--window", "4"]
    outputs = []
    for source in (str(tmp_path / "doc.txt"), "-"):
        piped(text.encode())
        capsys.readouterr()
        assert main(["generate", "--context-file", source, *flags, "--question", "w3 w4", "--max-new-tokens", "3"]) == 0
        outputs.append(capsys.readouterr().out.splitlines()[0])
        piped(text.encode())
        out = tmp_path / f"{'stdin' if source == '-' else 'file'}.kvc"
        assert main(["compress", "--context-file", source, *flags, "--out", str(out)]) == 0
    assert outputs[0] == outputs[1]
    assert (tmp_path / "file.kvc").read_bytes() == (tmp_path / "stdin.kvc").read_bytes()
    for data, expected in ((b" \n", "--context-file '-' (standard input) is empty but for white space: pass text holding the context"),
                           ("Caf\xe9".encode("latin-1"), "--context-file '-' (standard input) is not UTF-8 text")):
        piped(data)
        capsys.readouterr()
        assert main(["generate", "--context-file", "-", "--model", str(tmp_path / "no-such-model"), "--budget", "8"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], err


def test_standard_input_closed_a_terminal_or_without_bytes(monkeypatch, capsys):
    """`--context-file -` with standard input closed is one error line (it was an AttributeError traceback); a terminal
    gets a hint on stderr that the context is read until Ctrl-D; a text-only stdin (no `.buffer`) is read; line ends are
    a text file's (CRLF and CR read as LF)."""
    import io

    from kvcompress.commands.generate import read_context

    monkeypatch.setattr("sys.stdin", None)
    assert main(["generate", "--context-file", "-", "--budget", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvcompress generate: error: --context-file '-' reads standard input, which is closed: pipe the context in, or "
                   "name a file"]

    class Terminal(io.TextIOWrapper):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdin", Terminal(io.BytesIO(b"typed\r\ncontext\rhere")))
    assert read_context(Path("-")) == "typed\ncontext\nhere"
    assert "reading the context from standard input; end it with Ctrl-D" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("no bytes layer\r\n"))
    assert read_context(Path("-")) == "no bytes layer\n"


def test_compress_without_a_size_does_not_suggest_the_method_it_refuses(context_file, tmp_path, capsys):
    assert main(["compress", "--context-file", str(context_file), "--out", str(tmp_path / "c.kvc")]) == 2
    assert capsys.readouterr().err.strip() == "kvcompress compress: error: pass --compression-ratio, --budget or --calibration with --quality"


def test_demo_refuses_a_model_without_a_scorer_before_its_table(tiny_checkpoint, capsys):
    """`kvcompress demo --model M` for a model no scorer ships for: one error naming `kvcompress train-scorer` and --scorer,
    before the demo prints anything or answers; with --scorer of another model's shapes, an error naming that file."""
    from kvcompress.methods.kvzap import SHIPPED, shipped_path

    capsys.readouterr()
    assert main(["demo", "--model", str(tiny_checkpoint), "--tokens", "400"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "kvcompress train-scorer --model ... --out FILE` and pass --scorer FILE" in err, (out, err)
    another = str(shipped_path(next(iter(SHIPPED))))
    assert main(["demo", "--model", str(tiny_checkpoint), "--tokens", "400", "--scorer", another]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"kvcompress demo: error: --scorer {another!r}: " in err and "another model" in err, (out, err)


@pytest.mark.parametrize("first, second", [("sweep", "perplexity"), ("perplexity", "sweep")])
def test_a_results_folder_takes_one_kind_of_run_refused_before_the_model_loads(first, second, tmp_path, capsys, monkeypatch):
    """A perplexity run into a task sweep's folder was taken: its records joined the sweep's, its summary replaced the
    sweep's, and the next sweep into the folder failed in the middle ("wilson needs 0 <= successes <= n")."""
    from kvcompress.eval.perplexity import PerplexityConfig, check_perplexity_folder
    from kvcompress.eval.runner import SweepConfig, check_results_folder, write_run_config

    kinds = {"sweep": (SweepConfig(methods=["knorm"], tasks=["niah_single"]), {}),
             "perplexity": (PerplexityConfig(methods=["knorm"]), {"task": "perplexity"})}
    config, extra = kinds[first]
    write_run_config(tmp_path, config, "m", None, **extra)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # written whole: no partial file left
    check = {"sweep": check_results_folder, "perplexity": check_perplexity_folder}
    with pytest.raises(ValueError, match=r"holds the records of a .* which a .* must not add to .* write to another folder \(--out\)"):
        check[second](kinds[second][0], tmp_path, "m")
    check[first](config, tmp_path, "m")  # the same kind goes on
    # ... and the command line refuses it before loading a model
    monkeypatch.setattr("kvcompress.integration.load_model", lambda *a, **k: pytest.fail("the model loaded"))
    argv = {"sweep": ["eval", "--methods", "knorm", "--tasks", "niah_single"],
            "perplexity": ["eval", "--methods", "knorm", "--tasks", "perplexity"]}[second]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert "must not add to" in capsys.readouterr().err


def test_a_resumed_run_keeps_what_every_earlier_run_s_named_settings_stood_for(tmp_path):
    """config.json is rewritten by each run into a folder: the named settings of a first run with `default` must stay, or a
    third run whose `default` stands for another method would not be refused."""
    import json

    from kvcompress.eval.runner import SweepConfig, check_results_folder, write_run_config

    write_run_config(tmp_path, SweepConfig(methods=["default"], tasks=["niah_single"]), "m", None)
    write_run_config(tmp_path, SweepConfig(methods=["knorm"], tasks=["niah_single"]), "m", None)
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["config"]["methods"] == ["knorm"] and "default" in meta["named_settings"]
    meta["named_settings"]["default"] = {"prefill": ["snapkv", {}, {}]}  # as another version of kvcompress recorded it
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"method 'default' \(--methods\) stands for"):
        check_results_folder(SweepConfig(methods=["default"], tasks=["niah_single"]), tmp_path, "m")


def test_a_resumed_prefill_only_run_is_not_refused_for_the_streams_block_size(tmp_path):
    from kvcompress.eval.runner import SweepConfig, check_results_folder, write_run_config

    write_run_config(tmp_path, SweepConfig(methods=["knorm"], tasks=["niah_single"], modes=["chunked"], chunk_size=64), "m", None)
    prefill_only = SweepConfig(methods=["knorm"], tasks=["niah_single"], modes=["prefill"])
    check_results_folder(prefill_only, tmp_path, "m")
    write_run_config(tmp_path, prefill_only, "m", None)  # ... and its config.json keeps the streams' block size
    with pytest.raises(ValueError, match=r"chunk_size \(--chunk-size\) 256, there 64"):
        check_results_folder(SweepConfig(methods=["knorm"], tasks=["niah_single"], modes=["decode"]), tmp_path, "m")
    check_results_folder(SweepConfig(methods=["knorm"], tasks=["niah_single"], modes=["decode"], chunk_size=64), tmp_path, "m")


def test_ctrl_c_ends_a_command_with_one_line_and_how_to_go_on(monkeypatch, tmp_path, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    import kvcompress.commands.eval as eval_command

    monkeypatch.setattr(eval_command, "_run_sweep", interrupted)
    assert main(["eval", "--methods", "knorm", "--tasks", "niah_single", "--out", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert err == "kvcompress eval: interrupted; run the same command again to go on: the cells already recorded in --out are kept\n"


def test_damaged_results_and_an_unwritable_one_are_refused_naming_the_file_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """A results folder's config.json that is empty or not an object ("Expecting value: line 1 column 1", or a traceback
    "'list' object has no attribute 'get'"), a bench CSV cut short (a traceback from --report-only) or holding no rows,
    and an eval --out whose earlier records cannot be written (found by the first write, after the model loaded): one
    line each, naming the file, before any model loads. `--out=~/x` (no shell expands that `~`) is the home folder's x,
    not a folder named "~"."""
    import os

    from kvcompress.commands import common
    from kvcompress.eval.tables import write_csv
    from kvcompress.integration import model as model_module

    monkeypatch.setattr(model_module, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    sweep = ["eval", "--tasks", "niah_single", "--methods", "knorm", "--samples", "1", "--lengths", "256"]

    def refused(argv) -> str:
        assert main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        return err[0]

    for name, text, what in (("empty", "", "Expecting value"), ("list", "[1]", "got a list")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
        line = refused([*sweep, "--out", tmp_path / name])
        assert f"{str(tmp_path / name / 'config.json')!r} is not the JSON of a run's settings" in line and what in line, line
    rows = [{"method": "knorm", "n": 64, "seconds": 0.5}, {"method": "snapkv", "n": 64, "seconds": 0.25}]
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    cut = tmp_path / "home" / "cut" / "overhead.csv"
    write_csv(cut, rows)
    whole = cut.read_text()
    cut.write_text(whole[: whole.index("snapkv") + 9])
    assert refused(["bench", "--report-only", "--out=~/cut"]).endswith(
        f"--out: {str(cut)!r} line 3 has 2 cells where its header has 3 (a file cut short or edited?)")
    assert not (tmp_path / "~").exists()
    cut.write_text(whole.splitlines()[0] + "\n")
    assert f"overhead.csv in {str(cut.parent)!r} holds no rows" in refused(["bench", "--report-only", "--out", cut.parent])
    # an earlier run's records this user may not write (what os.access says for a user other than root)
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "results.jsonl").write_text("")
    writable = os.access
    monkeypatch.setattr(common.os, "access", lambda path, mode: Path(path).name != "results.jsonl" and writable(path, mode))
    assert refused([*sweep, "--out", tmp_path / "done"]).endswith(
        f"--out {str(tmp_path / 'done')!r}: results.jsonl cannot be written (an earlier run's files, which this one adds to or "
        "rewrites); make them writable or write to a new folder")
    monkeypatch.undo()


def test_a_results_folder_of_another_command_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """`bench --out` an eval folder, `eval --out` a bench folder and `eval approx --out` a task sweep's folder were taken,
    and mixed the commands' files and reports in one folder: each is refused naming the other command's files, before
    any model loads; a folder of the command's own kind goes on."""
    from kvcompress.integration import model as model_module

    monkeypatch.setattr(model_module, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    folders = {"eval": ("results.jsonl", "config.json"), "bench": ("machine.txt", "bench.md"), "eval approx": ("approx.csv", "approx.md")}
    for command, files in folders.items():
        (tmp_path / command).mkdir()
        for name in files:
            (tmp_path / command / name).write_text("")
    runs = {"eval": ["eval", "--tasks", "niah_single", "--methods", "knorm", "--samples", "1", "--lengths", "256"],
            "bench": ["bench", "--sections", "overhead", "--methods", "knorm", "--shapes", "smollm2", "--sizes", "32", "--repeats", "1"],
            "eval approx": ["eval", "approx", "--methods", "knorm", "--ratios", "0.5", "--layers", "0", "--tokens", "1024"]}
    for command, argv in runs.items():
        for other in folders:
            if other == command:
                continue
            assert main([*argv, "--out", str(tmp_path / other)]) == 2, (command, other)
            err = capsys.readouterr().err
            assert f"holds the results of `kvcompress {other}`" in err and f"`kvcompress {command}` writes into a folder of its own" in err, err
