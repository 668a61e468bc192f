"""$VAR templates in the user's ds_config: concrete launched configs, every candidate in the knob phase."""
import json

import pytest

from zerotune.cli import main
from zerotune.core.errors import ConfigError
from zerotune.core.launch import Node
from zerotune.inputs.configs import ConfigBuilder
from zerotune.inputs.job import Job, TuneOptions
from zerotune.inputs.variables import parse_cli_variable, parse_variables, placeholder_paths

GiB = 2**30
TEMPLATE = {"train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": "$LR", "betas": ["$B1", 0.999]}},
            "zero_optimization": {"stage": [1, 3], "overlap_comm": "$OC", "offload_optimizer": {"device": "${DEV}"}},
            "autotuning": {"variables": {"LR": 1e-3, "B1": [0.9], "OC": [False, True], "DEV": ["none"]}}}


def job_for(tmp_path, config=TEMPLATE, **variables):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    opts = TuneOptions(device_memory_bytes=3 * GiB, cpu=True, results_dir=str(tmp_path / "results"),
                       variables=variables)
    return Job.build("train.py", ["--deepspeed_config", str(path)], [Node("localhost", (0, 1))], opts)


def test_placeholders_are_found_at_their_keys():
    assert placeholder_paths({**TEMPLATE, "x": "a$$b", "autotuning": {"y": "$Z"}}) == {
        "LR": ["optimizer.params.lr"], "B1": ["optimizer.params.betas"], "OC": ["zero_optimization.overlap_comm"],
        "DEV": ["zero_optimization.offload_optimizer.device"]}


def test_every_launched_config_takes_the_first_candidates_and_the_knob_phase_each(tmp_path):
    job = job_for(tmp_path)
    assert job.variables == {"LR": [1e-3], "B1": [0.9], "OC": [False, True], "DEV": ["none"]}
    builder = ConfigBuilder(job)
    for cfg in (builder.profile().ds_config, builder.config(1, 4)):
        assert cfg["optimizer"]["params"] == {"lr": 1e-3, "betas": [0.9, 0.999]}
        assert cfg["zero_optimization"]["overlap_comm"] is False
        assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "none"}
    knobs = builder.knob_space(1, 4)
    assert {c.ds_config["zero_optimization"]["overlap_comm"] for c in knobs} == {False, True}
    assert len({c.name for c in knobs}) == len(knobs)
    assert all(c.ds_config["optimizer"]["params"]["lr"] == 1e-3 for c in knobs)


def test_the_command_line_wins_over_the_config(tmp_path):
    job = job_for(tmp_path, OC=True, LR=[3e-4, 1e-3])
    assert (job.variables["OC"], job.variables["LR"]) == ([True], [3e-4, 1e-3])
    assert ConfigBuilder(job).config(1, 2)["optimizer"]["params"]["lr"] == 3e-4


@pytest.mark.parametrize("variables,message", [
    ({"LR": 1, "B1": 1, "OC": 1}, r"'zero_optimization.offload_optimizer.device' holds the placeholder \$DEV, which "
                                  r"no variable gives: set \"autotuning\": \{\"variables\": \{\"DEV\": \[...\]\}\} or "
                                  r"pass --var DEV=VALUE"),
    ({"LR": 1, "B1": 1, "OC": 1, "DEV": "cpu", "X": 2}, r"variable \$X is used by no \$-placeholder in the config"),
    ({"LR": 1, "B1": 1, "OC": [], "DEV": "cpu"}, r"variable \$OC = \[\]: expected at least one candidate"),
    ({"L-R": 1}, r"variable 'L-R': expected a name of letters, digits and _"),
])
def test_variables_that_do_not_match_the_placeholders_are_errors(variables, message):
    with pytest.raises(ConfigError, match=r"^ds\.json: " + message):
        parse_variables(variables, TEMPLATE, "ds.json")


def test_a_placeholder_where_zerotune_searches_is_refused():
    with pytest.raises(ConfigError, match=r"'train_micro_batch_size_per_gpu' holds the placeholder \$MBS: zerotune "
                                          r"searches train_micro_batch_size_per_gpu itself"):
        parse_variables({"MBS": [1, 2]}, {"train_micro_batch_size_per_gpu": "$MBS"})


def test_cli_variables_are_json_or_text():
    assert parse_cli_variable("RBS=[5e7, 5e8]") == ("RBS", [5e7, 5e8])
    assert parse_cli_variable("OC=true") == ("OC", True)
    assert parse_cli_variable("DEV=cpu") == ("DEV", "cpu")
    with pytest.raises(ConfigError, match=r"--var 'RBS': expected NAME=VALUE"):
        parse_cli_variable("RBS")


def test_the_cli_takes_variables_and_names_a_missing_one(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**TEMPLATE, "autotuning": {}}))
    (tmp_path / "train.py").write_text("")
    args = ["tune", "--num_gpus", "2", "--device-memory", "3GiB", "--results-dir", str(tmp_path / "r"), "--dry-run",
            "--json", "--var", "LR=1e-3", "--var", "B1=[0.9]", "--var", "OC=[false, true]",
            str(tmp_path / "train.py"), "--deepspeed_config", str(path)]
    assert main(args) == 2
    assert "holds the placeholder $DEV, which no variable gives" in capsys.readouterr().err
    assert main(args[:-3] + ["--var", "DEV=none"] + args[-3:]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan and all("$" not in json.dumps(row) for row in plan["experiments"])
