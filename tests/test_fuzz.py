"""Property-based fuzzing (Hypothesis) of what a user hands zerotune: ds_configs and their
``autotuning`` sections, hostfiles, and the command line (issue 13).

The property, for every input: ``zerotune tune --dry-run`` either accepts it (exit 0, and every
experiment it plans has a directory that resolves inside the exps dir) or exits 2 with a
``zerotune: error:`` message that names the file, the key or the argument at fault; never a
traceback, and nothing is created anywhere (a dry run writes nothing). The dry run resolves every
input the real run does (the Job, the resources, the strategy against the memory model), so an
input it accepts is one the real run starts on.

The example database (``.hypothesis/``) is kept out of git; the whole module runs in well under a
minute.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerotune import cli
from zerotune.deepspeed.config import AutotuningConfig
from zerotune.run.scheduler import experiment_dir

FUZZ = settings(max_examples=int(os.environ.get("ZEROTUNE_FUZZ_EXAMPLES", "100")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow], derandomize=bool(os.environ.get("CI")))

SCRIPT = "train.py"

json_scalars = (st.none() | st.booleans() | st.integers(-3, 2**33) | st.floats(allow_nan=True, allow_infinity=True)
                | st.text(max_size=6) | st.sampled_from(["auto", "all", "$X", "$$", "cpu", "none", "1e9", "8"]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
small_ints = st.integers(-2, 64)

ZERO_KEYS = ["stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
             "stage3_prefetch_bucket_size", "offload_optimizer", "offload_param", "sub_group_size"]
zero_values = st.one_of(small_ints, st.lists(small_ints, max_size=3), st.sampled_from([5e7, 5e8, "all", "auto"]),
                        st.dictionaries(st.sampled_from(["device", "pin_memory"]),
                                        st.sampled_from(["cpu", "none", "nvme", True, 3]), max_size=2), json_values)
zero_sections = st.dictionaries(st.sampled_from(ZERO_KEYS + ["../up", "a/b"]), zero_values, max_size=4)
batch_values = st.one_of(small_ints, st.lists(small_ints, max_size=3), st.just("auto"), json_values)
autotuning_sections = st.dictionaries(
    st.sampled_from(sorted(AutotuningConfig.model_fields) + ["fastest", ""]),
    st.one_of(small_ints, st.booleans(), json_values,
              st.sampled_from(["throughput", "latency", "flops", "gridsearch", "random", "model_based", "yes"]),
              st.fixed_dictionaries({"num_params": st.integers(-1, 10**10)})),
    max_size=5)
configs = st.fixed_dictionaries(
    {"autotuning": autotuning_sections},
    optional={"train_micro_batch_size_per_gpu": batch_values, "gradient_accumulation_steps": batch_values,
              "train_batch_size": batch_values, "zero_optimization": st.one_of(zero_sections, json_values),
              "fp16": st.dictionaries(st.just("enabled"), st.booleans() | json_scalars, max_size=1),
              "../../../ESCAPED": st.lists(small_ints, min_size=1, max_size=3), "optimizer": json_values})
plausible_configs = st.fixed_dictionaries(  # mostly valid, so the accepting path is fuzzed too
    {"train_micro_batch_size_per_gpu": st.integers(1, 4) | st.lists(st.integers(1, 8), min_size=1, max_size=3),
     "zero_optimization": st.fixed_dictionaries({"stage": st.sampled_from([0, 1, 2, 3, "all", [0, 3], [1, 2]])},
                                                optional={"reduce_bucket_size": st.sampled_from([5e7, [5e7, 5e8], 1]),
                                                          "overlap_comm": st.booleans() | st.just([True, False])}),
     "autotuning": st.fixed_dictionaries(
         {"model_info": st.fixed_dictionaries({"num_params": st.integers(1, 10**10)})},
         optional={"fast": st.booleans(), "max_train_micro_batch_size_per_gpu": st.integers(1, 16),
                   "max_train_batch_size": st.integers(1, 64), "tuner_type": st.sampled_from(["gridsearch", "random"]),
                   "tuner_num_trials": st.integers(1, 4), "metric": st.sampled_from(["throughput", "latency"])})},
    optional={"gradient_accumulation_steps": st.integers(1, 4) | st.lists(st.integers(1, 4), min_size=1, max_size=2),
              "train_batch_size": st.integers(1, 64), "../../../ESCAPED": st.lists(st.integers(1, 3), min_size=2,
                                                                                   max_size=2)})
config_texts = st.one_of(configs.map(json.dumps), plausible_configs.map(json.dumps), plausible_configs.map(json.dumps),
                         st.text(max_size=40), st.just("[1, 2]"), st.just(""))

hostfile_lines = st.one_of(
    st.builds(lambda h, n, tail: f"{h} slots={n}{tail}", st.sampled_from(["localhost", "worker-0", "w1", ""]),
              st.integers(-2, 9).map(str) | st.sampled_from(["8x", "", "+2", "1e3"]),
              st.sampled_from(["", " # c", " max_slots=8", "\t"])),
    st.text(max_size=20))
hostfiles = st.lists(hostfile_lines, max_size=4).map("\n".join)

flag_values = {
    "--num_gpus": st.integers(-2, 40).map(str) | st.text(max_size=3),
    "--num_nodes": st.integers(-2, 4).map(str),
    "--device-memory": st.sampled_from(["2GiB", "3GiB", "1e400", "1KiB", "0", "-1GB", "2.5GB", "lots", "1e19", ""]),
    "--include": st.text(alphabet="localhostw-0123,:@a", max_size=14),
    "--exclude": st.text(alphabet="localhostw-0123,:@", max_size=12),
    "--timeout": st.sampled_from(["-5", "0", "nan", "inf", "30", "x"]),
    "--hang-timeout": st.sampled_from(["-1", "5", "nan"]),
    "--results-dir": st.sampled_from(["{tmp}/r", "{tmp}/afile", "{tmp}/afile/sub", "/proc/zerotune", "", "{tmp}/r/../r2"]),
    "--backend": st.sampled_from(["local", "ray", "slurm"]),
    "--precision": st.sampled_from(["0.02", "0", "2", "-1", "nan"]),
    "--var": st.sampled_from(["X=1", "X", "=3", "LR=[1e-4, 3e-4]"]),
}
cli_flags = st.lists(st.sampled_from(sorted(flag_values)), max_size=4, unique=True).flatmap(
    lambda flags: st.tuples(*[flag_values[f].map(lambda v, f=f: [f, v]) for f in flags]))


def dry_run(tmp: Path, config_text: str, flags: list[str], hostfile: str | None = None):
    """Run ``zerotune tune --dry-run --json`` in-process from ``tmp``; (exit code, stdout, stderr)."""
    (tmp / "ds.json").write_text(config_text)
    (tmp / SCRIPT).write_text("print('never run')\n")
    (tmp / "afile").write_text("a file\n")
    if hostfile is not None:
        (tmp / "hostfile").write_text(hostfile)
        flags = ["--hostfile", str(tmp / "hostfile"), *flags]
    flags = [f.replace("{tmp}", str(tmp)) for f in flags]
    if "--results-dir" not in flags:
        flags += ["--results-dir", str(tmp / "r")]
    if not any(f in flags for f in ("--num_gpus", "--include", "--hostfile")):
        flags = ["--num_gpus", "1", *flags]
    if "--device-memory" not in flags:
        flags += ["--device-memory", "2GiB"]
    argv = ["tune", "--dry-run", "--json", *flags, str(tmp / SCRIPT), "--deepspeed_config", str(tmp / "ds.json")]
    out, err = io.StringIO(), io.StringIO()
    before = sorted(p.relative_to(tmp) for p in tmp.rglob("*"))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse: a flag's value of the wrong type, with its usage line
            code = e.code
    assert sorted(p.relative_to(tmp) for p in tmp.rglob("*")) == before, "a dry run created files"
    return code, out.getvalue(), err.getvalue(), argv


def check(tmp: Path, code, out: str, err: str, argv: list[str]) -> None:
    assert "Traceback" not in err, err
    assert code in (0, 2), (code, argv, err[-2000:])
    if code == 2:
        found = list(re.finditer(r"^zerotune( tune)?: error: ", err, re.M))  # (a key may hold a line break)
        assert found, (argv, err)
        message = err[found[-1].start():]
        # names the file, the argument or the key: the config or hostfile path, or a --flag
        assert re.search(r"ds\.json|hostfile|--[a-z]", message), (argv, err)
        return
    plan = json.loads(out)
    exps = Path(argv[argv.index("--results-dir") + 1]) / "exps"
    for exp in plan["experiments"]:
        assert experiment_dir(exps, exp["name"]).resolve().parent == exps.resolve()


@FUZZ
@given(config=config_texts)
def test_any_ds_config_is_accepted_or_named_with_exit_2(config):
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        check(tmp, *dry_run(tmp, config, []))


@FUZZ
@given(hostfile=hostfiles, flags=cli_flags)
def test_any_hostfile_and_resource_flags_are_accepted_or_named_with_exit_2(hostfile, flags):
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        config = json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
                             "autotuning": {"model_info": {"num_params": 1000}}})
        check(tmp, *dry_run(tmp, config, [v for pair in flags for v in pair], hostfile))


@FUZZ
@given(config=configs | plausible_configs, flags=cli_flags)
def test_any_command_line_with_any_config_is_accepted_or_named_with_exit_2(config, flags):
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        check(tmp, *dry_run(tmp, json.dumps(config), [v for pair in flags for v in pair]))
