"""Every option of every command refuses the empty string and values its type cannot hold: exit status 2 with a
message naming the option and the value, and nothing written (issue 39, item 5; :mod:`zerotune.core.arguments`).

The options are read off the CLI's own parser, so an option added later is held to the rule without a new test.
The commands run in-process and for real (``zerotune tune`` without ``--dry-run``): exit 2 comes before anything
is written or launched.
"""
from __future__ import annotations

import argparse
import json

import pytest

from tests.helpers.cli_inputs import CONFIG, cli_exit, files, full_argv, value_actions
from zerotune.core.arguments import MAX_COUNT

EMPTY = "'': expected a value, not the empty string (an unset shell variable?)"


def action_name(action: argparse.Action) -> str:
    """How argparse names the argument in its messages."""
    return "/".join(action.option_strings) or action.metavar or action.dest


@pytest.mark.parametrize("command, action", value_actions(),
                         ids=[f"{c} {action_name(a)}" for c, a in value_actions()])
def test_every_option_of_every_command_refuses_the_empty_string(tmp_path, command, action):
    files(tmp_path)
    if action.option_strings:
        argv = full_argv(tmp_path, command, [action.option_strings[0], ""])
    else:
        argv = full_argv(tmp_path, command, [], positional="")
    code, err = cli_exit(tmp_path, argv)
    assert code == 2
    assert err.splitlines()[-1] == f"zerotune {command}: error: argument {action_name(action)}: {EMPTY}"


HUGE = "99999999999999999999"
PARSER_REFUSES = [  # (command, flags, the argument as argparse names it, the message after it)
    ("tune", ["--num_gpus", HUGE], "--num_gpus/--num_accelerators", f"'{HUGE}': expected a whole number from -1 to "
                                                                     f"{MAX_COUNT}"),
    ("run", ["--num_nodes", "1.5"], "--num_nodes", f"'1.5': expected a whole number from -1 to {MAX_COUNT}"),
    ("tune", ["--num_nodes", "-2"], "--num_nodes", f"'-2': expected a whole number from -1 to {MAX_COUNT}"),
    ("tune", ["--master_port", "70000"], "--master_port", "'70000': expected a whole number from 1 to 65535"),
    ("tune", ["--results-dir", "a\0b"], "--results-dir", "'a\\x00b': holds a NUL character, which no argument can"),
    ("tune", ["--train-samples", "1e400"], "--train-samples",
     "'1e400': expected a positive whole number, e.g. 1000000 or 1e6"),
    ("tune", ["--timeout", "x"], "--timeout", "invalid float value: 'x'"),
    ("estimate", ["--seq-len", "0"], "--seq-len", "'0': expected a whole number from 1 to 2147483647"),
    ("estimate", ["--mp-size", HUGE], "--mp-size", f"'{HUGE}': expected a whole number from 1 to {MAX_COUNT}"),
    ("estimate", ["--max-mbs", "-1"], "--max-mbs", "'-1': expected a whole number from 1 to 2147483647"),
    ("estimate", ["--num_nodes", "0"], "--num_nodes", f"'0': expected a whole number from 1 to {MAX_COUNT}"),
    ("estimate", ["--num_gpus", "8.0"], "--num_gpus/--num_accelerators",
     f"'8.0': expected a whole number from 1 to {MAX_COUNT}"),
]


@pytest.mark.parametrize("command, flags, name, message", PARSER_REFUSES, ids=[" ".join(c[1]) for c in PARSER_REFUSES])
def test_a_value_the_options_type_cannot_hold_is_refused_by_the_parser(tmp_path, command, flags, name, message):
    files(tmp_path)
    code, err = cli_exit(tmp_path, full_argv(tmp_path, command, flags))
    assert code == 2
    assert err.splitlines()[-1] == f"zerotune {command}: error: argument {name}: {message}"


CHECK_REFUSES = [  # (flags, the message): values the parser takes and zerotune's checks refuse
    (["--timeout", "inf"], "--timeout inf: expected seconds from 1 to 10,000,000 (about 115 days)"),
    (["--hang-timeout", "1e400"], "--hang-timeout inf: expected seconds from 1 to 10,000,000 (about 115 days)"),
    (["--include", f"localhost:{HUGE}"], f"--include 'localhost:{HUGE}': a device id above {MAX_COUNT - 1}, more than "
                                         "a node has"),
    (["--var", "X=" + "[" * 100 + "]" * 100],
     "--var 'X=" + "[" * 38 + "...': VALUE is JSON nested deeper than the 64 levels zerotune reads; expected JSON (a "
     "list of candidates) or text"),
]


@pytest.mark.parametrize("flags, message", CHECK_REFUSES, ids=[c[0][0] for c in CHECK_REFUSES])
def test_a_value_the_option_cannot_mean_is_exit_2_naming_it(tmp_path, flags, message):
    files(tmp_path)
    code, err = cli_exit(tmp_path, full_argv(tmp_path, "tune", flags))
    assert (code, err) == (2, f"zerotune: error: {message}\n")


@pytest.mark.parametrize("key, value, message", [
    ("results_dir", "", "'autotuning.results_dir' = '': String should have at least 1 character"),
    ("exps_dir", "", "'autotuning.exps_dir' = '': String should have at least 1 character"),
    ("exps_dir", "a\0b", "'autotuning.exps_dir' = 'a\\x00b': Value error, a path cannot hold a NUL character"),
])
def test_the_configs_results_and_exps_dirs_are_paths(tmp_path, monkeypatch, key, value, message):
    """An empty ``autotuning.results_dir`` would put the results in the working directory."""
    monkeypatch.chdir(tmp_path)
    config = files(tmp_path)
    config.write_text(json.dumps({**CONFIG, "autotuning": {**CONFIG["autotuning"], key: value}}))
    code, err = cli_exit(tmp_path, ["tune", "--num_gpus", "1", "--device-memory", "2GiB", str(tmp_path / "train.py"),
                                    "--deepspeed_config", str(config)])
    assert (code, err) == (2, f"zerotune: error: {config}: {message}\n")
