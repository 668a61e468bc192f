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

from tests.helpers import cli_inputs
from zerotune import cli
from zerotune.core.user_files import MAX_FILE_BYTES, MAX_JSON_DEPTH
from zerotune.deepspeed.config import CONFIG_RULE, AutotuningConfig
from zerotune.run.backends import BACKENDS
from zerotune.run.store import experiment_dir

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
    "--backend": st.sampled_from(BACKENDS),
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


# --- issue 39: bad input by class ----------------------------------------------------------------------------------
# Every option of every command given a value of a class its type cannot hold, every file a reader takes given a file
# of a class it must refuse (special files, too large, too deep, not UTF-8), and configs of any depth and of sizes
# around the bound: exit status 2 naming the option (or the file) and the value, no traceback, nothing written. The
# commands run for real, not as dry runs: exit 2 must come before anything is written or launched.

HUGE = "99999999999999999999"
EVERY = ["", "\0", "a\0b"]  # refused for every option: the empty string (an unset variable) and a NUL character
WHOLE = ["-2", "1.5", "1e3", "0x10", HUGE, "nan", "one"]
FLOATS = ["nan", "inf", "-inf", "1e400", "-1", "x"]
SIZES = ["nan", "inf", "1e400", "-1GB", "lots", "3 parsecs"]
PARAMS = ["0", "-5", "nan", "1e400", "lots"]
FILES = [f"{{bad}}/{kind}" for kind in (*cli_inputs.NOT_REGULAR, *cli_inputs.CONTENT)
         if kind != "dev-zero"] + ["/dev/zero"]
PROJECTION = {"--train-samples": ["0", "-1", "1e400", "nan", "1.5", "x", "-1e3"],
              "--train-steps": ["0", "-1", "1e400", "nan", "1.5", "x", "-1e3"],
              "--cost-per-device-hour": FLOATS, "--peak-tflops": [*FLOATS, "0"]}
TUNE = {"--hostfile": FILES, "--include": ["localhost:a", "localhost:-1", f"localhost:{HUGE}", "nohost", "localhost:0,,1"],
        "--exclude": ["localhost:a", "nohost", "localhost:0"], "--num_nodes": [*WHOLE, "2"], "--num_gpus": WHOLE,
        "--master_port": [*WHOLE, "70000"], "--results-dir": ["{tmp}/afile", "{tmp}/afile/sub", "/proc/self/zt",
                                                              "/dev/zero"],
        "--device-memory": [*SIZES, "0"], "--host-memory": [*SIZES, "0"],
        "--nvme-path": ["{tmp}/afile", "/dev/zero", "{tmp}/nope"],
        "--timeout": [*FLOATS, "0", "1e-9", "1e308"], "--hang-timeout": [*FLOATS, "0", "0.5", "2e7"], "--var": ["X", "=3", "X=" + "[" * 100 + "]" * 100, "X=" + "[" * 5000],
        "--precision": [*FLOATS, "0", "1", "2"], "--backend": ["LOCAL", "mpi"], "--address": ["10.0.0.1:6379"],
        "--max-launches": [*WHOLE, "0", "1"], "--max-device-hours": [*FLOATS, "0"], "--max-seq-len": [*WHOLE, "0"],
        **PROJECTION, "user_script": ["{bad}/missing", "/dev/zero", "{bad}/directory", "{bad}/fifo"],
        "--deepspeed_config": FILES}
BAD = {"tune": TUNE, "run": TUNE,
       "estimate": {"--profile": FILES, "--hf-config": FILES, "--deepspeed": FILES, "--num-params": PARAMS,
                    "--trainable-params": [*PARAMS, "2e9"], "--activation-bytes": SIZES, "--seq-len": [*WHOLE, "0"],
                    "--num_gpus": [*WHOLE, "0"], "--num_nodes": [*WHOLE, "0"], "--device-memory": [*SIZES, "0"],
                    "--host-memory": [*SIZES, "0"], "--precision": ["fp8", "FP16"], "--mp-size": [*WHOLE, "0", "3"],
                    "--overhead": SIZES, "--max-mbs": [*WHOLE, "0"], "--attention": ["EAGER", "flash_attention_2"]},
       "report": {"results_dir": ["/dev/zero", "{tmp}/afile", "{tmp}/nope", "{tmp}"],
                  "--exps-dir": ["/dev/zero", "{tmp}/afile", "{tmp}/nope"], **PROJECTION}}
"""command -> option (a positional argument by its name; ``--deepspeed_config``: the training script's argument
that names the ds_config) -> values of the classes it must refuse, besides :data:`EVERY`."""


def test_the_bad_values_name_every_option_of_every_command():
    """A new option is fuzzed once it has its bad values here."""
    for command, action in cli_inputs.value_actions():
        assert (action.option_strings or [action.dest])[0] in BAD[command], (command, action.option_strings)


def shown(value: str) -> list[str]:
    """How a message may show ``value``: as given, quoted, its first 40 characters (a long one), or as the number it
    reads as (``1e400`` is ``inf``)."""
    forms = [value, repr(value), value[:40] if len(value) > 40 else ""]
    with contextlib.suppress(ValueError):
        forms.append(f"{float(value):g}")
    return [f for f in forms if f]


def bad_argv(tmp: Path, command: str, option: str, value: str) -> list[str]:
    if option == "--deepspeed_config":
        return cli_inputs.full_argv(tmp, command, [], config=value)
    if not option.startswith("-"):
        return cli_inputs.full_argv(tmp, command, [], positional=value)
    return cli_inputs.full_argv(tmp, command, [f"{option}={value}"] if value.startswith("-") else [option, value])


@FUZZ
@given(data=st.data())
def test_any_option_given_a_value_of_a_class_its_type_cannot_hold_is_exit_2_naming_it(data):
    command = data.draw(st.sampled_from(sorted(BAD)), label="command")
    option = data.draw(st.sampled_from(sorted(BAD[command])), label="option")
    value = data.draw(st.sampled_from([*EVERY, *BAD[command][option]]), label="value")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cli_inputs.files(tmp)
        cli_inputs.make_bad_files(tmp / "bad")
        value = value.replace("{tmp}", str(tmp)).replace("{bad}", str(tmp / "bad"))
        code, err = cli_inputs.cli_exit(tmp, bad_argv(tmp, command, option, value))  # asserts: no traceback, no write
    assert code == 2, (command, option, value, err[-500:])
    line = [t for t in err.splitlines() if re.match(r"zerotune( \w+)?: error: ", t)][-1]
    if option.startswith("-") and option != "--deepspeed_config":
        assert option in line or option.lstrip("-") + " " in line, line  # "hostfile PATH: ..." names --hostfile
    assert any(form in line for form in shown(value)), line


def nested(depth: int, kinds: list[str]) -> str:
    """JSON text nesting ``depth`` arrays and objects (``kinds`` cycled: ``[`` or ``{``) around a 1, built as text:
    a structure this deep would make json.dumps recurse out."""
    opens = [kinds[i % len(kinds)] for i in range(depth)]
    return "".join("[" if k == "[" else '{"k": ' for k in opens) + "1" + "".join(
        "]" if k == "[" else "}" for k in reversed(opens))


BASE = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
        "autotuning": {"model_info": {"num_params": 1000}}}
WHERE = {"optimizer": 1, "zero_optimization": 1, "scheduler": 1, "autotuning.model_info.x": 3}
"""Where the nested value goes, and how deep that place is in the config (the top object counts 1)."""


@FUZZ
@given(depth=st.integers(1, 3 * MAX_JSON_DEPTH) | st.sampled_from([MAX_JSON_DEPTH - 3, MAX_JSON_DEPTH - 1, 5000]),
       kinds=st.lists(st.sampled_from("[{"), min_size=1, max_size=3), where=st.sampled_from(sorted(WHERE)))
def test_a_config_of_any_depth_is_taken_within_the_bound_and_exit_2_naming_it_beyond(depth, kinds, where):
    text = json.dumps({**BASE, "autotuning": {"model_info": {"num_params": 1000, "x": "@"}}} if "." in where
                      else {**BASE, where: "@"})
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        code, out, err, argv = dry_run(tmp, text.replace('"@"', nested(depth, kinds)), [])
    check(tmp, code, out, err, argv)
    if depth + WHERE[where] > MAX_JSON_DEPTH:
        assert (code, err) == (2, f"zerotune: error: {tmp / 'ds.json'}: JSON nested deeper than the 64 levels zerotune "
                                  f"reads; {CONFIG_RULE}\n")


@settings(FUZZ, max_examples=6)
@given(size=st.sampled_from([MAX_FILE_BYTES - 1, MAX_FILE_BYTES, MAX_FILE_BYTES + 1, 3 * MAX_FILE_BYTES]),
       pad=st.sampled_from(["string", "numbers"]))
def test_a_config_is_taken_up_to_the_size_bound_and_is_exit_2_naming_it_beyond(size, pad):
    empty = json.dumps({**BASE, "pad": "" if pad == "string" else []})
    room = size - len(empty)
    text = empty.replace('""', '"' + "x" * room + '"') if pad == "string" else \
        empty.replace("[]", "[" + ",".join(["1"] * ((room + 1) // 2)) + (" " if room % 2 == 0 else "") + "]")
    assert len(text) == size
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        code, out, err, argv = dry_run(tmp, text, [])
    check(tmp, code, out, err, argv)
    expected = (0, "") if size <= MAX_FILE_BYTES else (
        2, f"zerotune: error: {tmp / 'ds.json'}: {size} bytes, more than the 4.00 MiB zerotune reads; {CONFIG_RULE}\n")
    assert (code, err if code else "") == expected, err[-500:]
