"""The user's own command after ``--``: each launcher read by its own parser, its ranks' contract, the answer in its
form, and bad commands refused with exit 2 before anything is created (zerotune.launchers)."""
import json
import sys
from pathlib import Path

import pytest

from zerotune import cli
from zerotune.core.errors import ConfigError
from zerotune.core.launch import LaunchSpec, Node, Reservation
from zerotune.deepspeed.launcher import launch_command, launch_env
from zerotune.inputs.job import Job, TuneOptions
from zerotune.launchers.accelerate import ANSWER_YAML, AccelerateLauncher
from zerotune.launchers.base import LIGHTNING_CONFIG_ENV, Launcher
from zerotune.launchers.command import KNOWN, read_command
from zerotune.launchers.contract import DEEPSPEED, OWN, TORCHRUN, rank_argv, torchrun_env
from zerotune.launchers.python import PythonLauncher
from zerotune.launchers.torchrun import TorchrunLauncher
from zerotune.run.backends.slurm_rank import contract_env, rank_env
from zerotune.run.resources import select_resources
from zerotune.run.resume import resume_context
from zerotune.run.warm.launcher import rank_environment

pytest.importorskip("accelerate")
GiB = 2**30
CONFIG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": [0, 1]}}
ACCELERATE_YAML = """compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  deepspeed_config_file: ds.json
  zero3_init_flag: false
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""
INLINE_YAML = """compute_environment: LOCAL_MACHINE
deepspeed_config:
  gradient_accumulation_steps: 4
  offload_optimizer_device: cpu
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
distributed_type: DEEPSPEED
mixed_precision: bf16
num_machines: 1
num_processes: 2
use_cpu: false
"""


@pytest.fixture
def job_dir(tmp_path, monkeypatch):
    """A working directory with train.py, ds.json and Accelerate configs (file and inline), as a user has them."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('train')\n")
    (tmp_path / "ds.json").write_text(json.dumps(CONFIG))
    (tmp_path / "zero.yaml").write_text(ACCELERATE_YAML)
    (tmp_path / "inline.yaml").write_text(INLINE_YAML)
    return tmp_path


# --- reading each launcher ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", [["torchrun"], [sys.executable, "-m", "torch.distributed.run"], ["python3", "-m",
                                                                                                   "torch.distributed.run"]])
def test_torchrun_is_read_by_torchs_parser_its_ranks_and_words_kept(head):
    user = read_command([*head, "--nproc_per_node", "3", "--max_restarts=0", "train.py", "--deepspeed", "ds.json",
                         "--nproc_per_node", "9"])
    assert isinstance(user.launcher, TorchrunLauncher) and user.launcher.contract == TORCHRUN
    assert user.launcher.words == (*head, "--nproc_per_node", "3", "--max_restarts=0")
    assert (user.script, user.script_args) == ("train.py", ("--deepspeed", "ds.json", "--nproc_per_node", "9"))
    assert (user.launcher.ranks_per_node, user.launcher.num_nodes) == (3, 1)


def test_the_deepspeed_form_keeps_the_slot_options_it_gave():
    user = read_command(["deepspeed", "--num_gpus", "2", "--include=localhost:0,1", "train.py", "--deepspeed_config",
                         "ds.json"])
    assert user.launcher.name == DEEPSPEED and user.launcher.contract == DEEPSPEED
    assert dict(user.launcher.options) == {"include": "localhost:0,1", "num_gpus": 2}
    assert (user.script, user.script_args) == ("train.py", ("--deepspeed_config", "ds.json"))
    other = read_command(["deepspeed", "--num_accelerators=4", "--hostfile", "hosts", "train.py", "--num_gpus", "1"])
    assert dict(other.launcher.options) == {"hostfile": "hosts", "num_gpus": 4}  # the script's own flag is its own


def test_accelerate_with_a_config_file_reads_its_deepspeed_config_file_and_sets_accelerates_variables(job_dir):
    user = read_command(["accelerate", "launch", "--config_file", "zero.yaml", "train.py", "--lr", "1"])
    launcher = user.launcher
    assert isinstance(launcher, AccelerateLauncher) and launcher.contract == TORCHRUN and not launcher.config_in_argv
    assert (launcher.ranks_per_node, launcher.config_path, user.script_args) == (2, "ds.json", ("--lr", "1"))
    path, config, where = launcher.load_config(user.script_args)
    assert (path, config, where) == ("ds.json", CONFIG, "deepspeed_config_file of zero.yaml: ds.json")
    env = launcher.rank_env("ds.json")
    # as accelerate launch sets them for this YAML (prepare_deepspeed_cmd_env), the config file the experiment's
    assert {k: v for k, v in env.items() if k != "PYTHONPATH"} == {
        "ACCELERATE_CONFIG_DS_FIELDS": "deepspeed_config_file,zero3_init_flag",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds.json", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
        "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_DEEPSPEED": "true"}
    assert env["PYTHONPATH"].split(":")[-1] == str(job_dir)  # accelerate launch adds its working directory


def test_accelerate_inline_fields_become_the_ds_config_accelerates_plugin_builds(job_dir):
    launcher = read_command(["accelerate", "launch", "--config_file", "inline.yaml", "train.py"]).launcher
    path, config, where = launcher.load_config(())
    assert path == "inline.yaml (inline DeepSpeed fields)" and launcher.config_path is None
    assert where == "the deepspeed_config fields of inline.yaml, as Accelerate's DeepSpeedPlugin builds them"
    assert config == {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                      "gradient_accumulation_steps": 4, "gradient_clipping": "auto",
                      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                            "offload_param": {"device": "none"},
                                            "stage3_gather_16bit_weights_on_model_save": False},
                      "fp16": {"enabled": False}, "bf16": {"enabled": True}}
    # an experiment's ranks get its config as a file, and none of the inline fields Accelerate refuses beside one
    env = launcher.rank_env("ds.json")
    assert env["ACCELERATE_CONFIG_DS_FIELDS"] == "zero3_init_flag"
    assert "ACCELERATE_DEEPSPEED_ZERO_STAGE" not in env and env["ACCELERATE_MIXED_PRECISION"] == "bf16"


def test_python_script_starts_its_own_ranks_and_takes_lightnings_config_variable(job_dir, monkeypatch):
    user = read_command(["python", "-u", "train.py", "--devices", "2", "--deepspeed", "ds.json"])
    assert isinstance(user.launcher, PythonLauncher) and user.launcher.contract == OWN
    assert user.launcher.words == ("python", "-u") and user.launcher.config_in_argv
    assert user.launcher.warm_note() == "python SCRIPT starts its own ranks (the script's launcher forks them), so " \
                                        "its runs go cold"
    monkeypatch.setenv(LIGHTNING_CONFIG_ENV, "ds.json")
    lightning = read_command(["python", "train.py", "--devices", "2"]).launcher
    assert not lightning.config_in_argv and lightning.load_config(())[1] == CONFIG
    assert lightning.rank_env("/exp/ds_config.json") == {LIGHTNING_CONFIG_ENV: "/exp/ds_config.json"}
    # a bare --deepspeed is DeepSpeed's switch, not a config: the config is still Lightning's variable
    switch = read_command(["python", "train.py", "--deepspeed", "--devices", "2"]).launcher
    assert not switch.config_in_argv and switch.load_config(())[0] == "ds.json"
    # a config given twice in the arguments is refused, not read from the variable instead
    with pytest.raises(ConfigError, match="carry a DeepSpeed config twice"):
        read_command(["python", "train.py", "--deepspeed", "a.json", "--deepspeed_config", "b.json"]).launcher.load_config(
            ["--deepspeed", "a.json", "--deepspeed_config", "b.json"])


def test_a_lightning_script_under_torchrun_takes_its_config_from_lightnings_variable(job_dir, monkeypatch):
    monkeypatch.setenv(LIGHTNING_CONFIG_ENV, "ds.json")
    user = read_command(["torchrun", "--nproc_per_node", "2", "train.py", "--devices", "2"])
    assert user.launcher.contract == TORCHRUN and not user.launcher.config_in_argv and user.launcher.warm_note() == ""
    assert user.launcher.load_config(user.script_args) == ("ds.json", CONFIG, f"${LIGHTNING_CONFIG_ENV} = ds.json")
    spec = LaunchSpec(script="train.py", script_args=user.script_args, cpu=True, launcher=user.launcher)
    slots = Reservation((Node("localhost", (0, 1)),))
    assert launch_env(spec, slots, config_path="/exp/ds.json")[LIGHTNING_CONFIG_ENV] == "/exp/ds.json"
    assert launch_command(spec, slots, "/exp/ds.json", 29511)[-3:] == ["train.py", "--devices", "2"]


@pytest.mark.parametrize("words, says", [
    (["mpirun", "-n", "2", "train.py"], "'mpirun': not a launcher zerotune knows (" + ", ".join(KNOWN)),
    (["python", "-m", "horovod.run", "train.py"], "'python -m horovod.run': not a launcher zerotune knows"),
    (["accelerate", "config"], "'accelerate config': zerotune reads 'accelerate launch ...'"),
    (["torchrun", "--nnodes", "2", "--nproc_per_node", "2", "train.py"], "torchrun --nnodes 2: zerotune starts every"),
    (["torchrun", "--module", "pkg.train"], "torchrun --module: zerotune tunes a training script given by its path"),
    (["python", "train.py"], "train.py: no DeepSpeed config: pass --deepspeed ds_config.json"),
    (["srun", "-n", "2", "python", "train.py"], "zerotune starts each experiment's job step itself"),
    ([], "no command after '--'"),
])
def test_a_command_zerotune_cannot_read_is_refused_naming_the_word(words, says, monkeypatch):
    monkeypatch.delenv(LIGHTNING_CONFIG_ENV, raising=False)
    with pytest.raises(ConfigError) as e:
        read_command(words)
    assert says in str(e.value)


def test_an_accelerate_config_that_is_not_accelerates_or_not_deepspeed_is_refused_naming_it(job_dir):
    (job_dir / "other.yaml").write_text("model: gpt2\nlr: 0.1\n")
    with pytest.raises(ConfigError, match=r"other.yaml: expected an Accelerate config .*A `distributed_type` must be specified"):
        read_command(["accelerate", "launch", "--config_file", "other.yaml", "train.py"])
    (job_dir / "ddp.yaml").write_text(ACCELERATE_YAML.replace("DEEPSPEED", "MULTI_GPU"))
    with pytest.raises(ConfigError, match=r"ddp.yaml: not a DeepSpeed launch \(distributed_type is not DEEPSPEED"):
        read_command(["accelerate", "launch", "--config_file", "ddp.yaml", "train.py"])
    with pytest.raises(ConfigError, match=r"Accelerate config missing.yaml: cannot read it \(No such file"):
        read_command(["accelerate", "launch", "--config_file", "missing.yaml", "train.py"])


# --- the rank contract -------------------------------------------------------------------------------------------


def test_torchrun_env_is_the_agents_worker_environment_without_an_agent():
    env = torchrun_env({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}, rank=3, local_rank=1, world_size=4,
                       local_world_size=2, node_rank=1, num_nodes=2)
    assert env == {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "RANK": "3", "LOCAL_RANK": "1",
                   "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
                   "ROLE_RANK": "3", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "4", "TORCHELASTIC_RESTART_COUNT": "0",
                   "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "zerotune",
                   "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                   "OMP_NUM_THREADS": "1"}
    assert torchrun_env({"OMP_NUM_THREADS": "4"}, 0, 0, 2, 2)["OMP_NUM_THREADS"] == "4"  # the user's stays
    assert "OMP_NUM_THREADS" not in torchrun_env({}, 0, 0, 1, 1)  # torchrun sets it only for several ranks
    assert rank_argv(DEEPSPEED, 1) == ["--local_rank=1"] and rank_argv(TORCHRUN, 1) == rank_argv(OWN, 1) == []


def test_a_warm_rank_gets_torchruns_variables_or_deepspeeds():
    torchrun = rank_environment({"X": "1"}, [2, 3], 1, "127.0.0.1", 29501, TORCHRUN)
    deepspeed = rank_environment({"X": "1"}, [2, 3], 1, "127.0.0.1", 29501)
    assert (torchrun["RANK"], torchrun["LOCAL_WORLD_SIZE"], torchrun["MASTER_PORT"], torchrun["X"]) == ("1", "2",
                                                                                                        "29501", "1")
    assert "LOCAL_SIZE" not in torchrun and "LOCAL_WORLD_SIZE" not in deepspeed
    assert (deepspeed["LOCAL_SIZE"], deepspeed["CROSS_SIZE"]) == ("2", "1")
    assert torchrun["CUDA_VISIBLE_DEVICES"] == deepspeed["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_a_slurm_task_gets_torchruns_variables_from_slurms():
    task = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NODEID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NUM_NODES": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    env = contract_env({**task, **rank_env(task)}, TORCHRUN)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "GROUP_WORLD_SIZE")} == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                                                         "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                                                         "GROUP_WORLD_SIZE": "2"}
    assert contract_env(dict(task), DEEPSPEED) == task


def test_a_cold_experiment_is_started_by_the_users_launcher_with_the_experiments_config(job_dir):
    user = read_command(["accelerate", "launch", "--config_file", "zero.yaml", "train.py", "--lr", "1"])
    spec = LaunchSpec(script="train.py", script_args=user.script_args, cpu=True, launcher=user.launcher)
    slots = Reservation((Node("localhost", (0, 1)),))
    assert launch_command(spec, slots, "/exp/ds.json", 29511) == [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2", "--master_addr",
        "127.0.0.1", "--master_port", "29511", "train.py", "--lr", "1"]
    env = launch_env(spec, slots, config_path="ds.json")
    assert (env["ACCELERATE_DEEPSPEED_CONFIG_FILE"], env["DS_ACCELERATOR"], env["LOCAL_SIZE"]) == ("ds.json", "cpu",
                                                                                                  "2")
    torchrun = read_command(["torchrun", "--nproc_per_node", "2", "train.py", "--deepspeed", "ds.json"])
    spec = LaunchSpec(script="train.py", script_args=torchrun.script_args, cpu=True, launcher=torchrun.launcher)
    assert launch_command(spec, slots, "/exp/ds.json", 29511)[-3:] == ["train.py", "--deepspeed", "/exp/ds.json"]


# --- the answer in the user's form ---------------------------------------------------------------------------------


def test_the_answer_is_the_users_torchrun_line_with_the_config_in_place():
    user = read_command(["torchrun", "--nproc_per_node", "2", "train.py", "--deepspeed=ds.json", "--lr", "1"])
    answer = user.launcher.answer("/abs/train.py", user.script_args, "/r/ds_config_optimal.json", Path("/r"), CONFIG)
    assert answer.words == ("torchrun", "--nproc_per_node", "2", "/abs/train.py",
                            "--deepspeed=/r/ds_config_optimal.json", "--lr", "1")
    assert answer.files == ()


def test_the_accelerate_answer_names_a_yaml_whose_config_file_is_the_answer(job_dir):
    import yaml
    user = read_command(["accelerate", "launch", "--config_file", "inline.yaml", "--zero_stage", "3",
                         "--main_process_port", "29600", "train.py", "--lr", "1"])
    answer = user.launcher.answer("/abs/train.py", user.script_args, "/r/ds_config_optimal.json", Path("/r"), CONFIG)
    assert answer.words == ("accelerate", "launch", "--config_file", f"/r/{ANSWER_YAML}", "--main_process_port",
                            "29600", "/abs/train.py", "--lr", "1")
    (name, text), = answer.files
    assert name == ANSWER_YAML
    assert yaml.safe_load(text) == {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED",
                                    "num_machines": 1, "num_processes": 2, "use_cpu": False,
                                    "deepspeed_config": {"zero3_init_flag": False,
                                                         "deepspeed_config_file": "/r/ds_config_optimal.json"}}
    # without a config file, the answer names the config on the command line
    bare = read_command(["accelerate", "launch", "--use_deepspeed", "--num_processes", "2", "--zero_stage", "2",
                         "train.py"])
    words = bare.launcher.answer("train.py", (), "/r/ds.json", Path("/r"), CONFIG).words
    assert words == ("accelerate", "launch", "--deepspeed_config_file", "/r/ds.json", "--use_deepspeed",
                     "--num_processes", "2", "train.py")


SP_YAML = ACCELERATE_YAML.replace("num_processes: 2", "num_processes: 4") + """parallelism_config:
  parallelism_config_sp_size: 2
  parallelism_config_sp_backend: deepspeed
"""


def test_accelerates_ulysses_degree_is_the_configs_and_each_experiments_reaches_the_ranks_as_accelerate_sets_it(
        job_dir):
    import yaml
    (job_dir / "sp.yaml").write_text(SP_YAML)
    user = read_command(["accelerate", "launch", "--config_file", "sp.yaml", "train.py"])
    launcher = user.launcher
    assert launcher.sp_size == 2 and [d for d, _ in launcher.sp_env] == [2, 4]  # the degrees that divide 4 ranks
    assert launcher.load_config(())[1] == {**CONFIG, "sequence_parallel_size": 2}
    for degree in (4, 1):  # the experiment's degree, over the YAML's: ParallelismConfig reads these variables
        config = job_dir / f"sp{degree}.json"
        config.write_text(json.dumps({**CONFIG, "sequence_parallel_size": degree}))
        env = {k: v for k, v in launcher.rank_env(str(config)).items() if "PARALLELISM" in k}
        assert env == ({"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "4",
                        "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1",
                        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1", "PARALLELISM_CONFIG_TP_SIZE": "1",
                        "PARALLELISM_CONFIG_CP_SIZE": "1", "PARALLELISM_CONFIG_CP_BACKEND": "torch",
                        "PARALLELISM_CONFIG_SP_SEQ_LENGTH": "None", "PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE":
                        "True", "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION": "sdpa"} if degree == 4
                       else {"ACCELERATE_USE_PARALLELISM_CONFIG": "false"})
    # the answer's YAML carries its degree, the other ranks as DP shards; at degree 1 no parallelism_config
    answer = launcher.answer("train.py", (), "/r/ds.json", Path("/r"), {"sequence_parallel_size": 2})
    assert yaml.safe_load(dict(answer.files)[ANSWER_YAML])["parallelism_config"] == {
        "parallelism_config_sp_size": 2, "parallelism_config_sp_backend": "deepspeed",
        "parallelism_config_dp_shard_size": 2, "parallelism_config_dp_replicate_size": 1}
    assert "parallelism_config" not in yaml.safe_load(dict(launcher.answer("train.py", (), "/r/ds.json", Path("/r"),
                                                                           CONFIG).files)[ANSWER_YAML])
    # the command line's degree is Accelerate's over the YAML's, and the answer's replaces it
    flagged = read_command(["accelerate", "launch", "--config_file", "sp.yaml", "--parallelism_config_sp_size=4",
                            "train.py"]).launcher
    assert flagged.sp_size == 4
    assert flagged.answer("train.py", (), "/r/ds.json", Path("/r"), {"sequence_parallel_size": 2}).words[4] == (
        "--parallelism_config_sp_size=2")


def test_a_ulysses_degree_accelerate_cannot_carry_or_that_leaves_out_the_launchs_is_refused_naming_the_key(job_dir):
    (job_dir / "sp.yaml").write_text(SP_YAML)
    (job_dir / "ds.json").write_text(json.dumps({**CONFIG, "sequence_parallel_size": [1, 4]}))
    with pytest.raises(ConfigError, match=r"^ds.json: 'sequence_parallel_size' = \[1, 4\] leaves out the Ulysses "
                                          r"degree 2 of the launch's parallelism_config \(parallelism_config_sp_"):
        read_command(["accelerate", "launch", "--config_file", "sp.yaml", "train.py"]).launcher.load_config(())
    bare = read_command(["accelerate", "launch", "--use_deepspeed", "--num_processes", "2", "--deepspeed_config_file",
                         "ds.json", "train.py"]).launcher
    with pytest.raises(ConfigError, match=r"^ds.json: 'sequence_parallel_size' = \[1, 4\]: accelerate launch gives "
                                          r"DeepSpeed a Ulysses degree only from its config file's parallelism_config"):
        bare.load_config(())


# --- the job and the command line ------------------------------------------------------------------------------------


def test_the_resume_key_of_the_deepspeed_form_is_unchanged_and_another_launcher_adds_its_own(job_dir):
    nodes, options = select_resources(local_slots=2), TuneOptions(device_memory_bytes=2 * GiB, cpu=True)
    plain = Job.build("train.py", ["--deepspeed", "ds.json"], nodes, options)
    torchrun = read_command(["torchrun", "--nproc_per_node", "2", "train.py", "--deepspeed", "ds.json"])
    tr = Job.build(torchrun.script, torchrun.script_args, nodes, options, torchrun.launcher)
    assert "launcher" not in resume_context(plain) and plain.launcher == Launcher()
    assert resume_context(tr) == {**resume_context(plain), "launcher": {
        "words": ["torchrun", "--nproc_per_node", "2"], "env": {}}}
    assert tr.launch_spec().launcher is torchrun.launcher and plain.launch_spec().launcher is None
    assert tr.config_source == "--deepspeed ds.json in the script's arguments"


def test_a_script_that_starts_its_own_ranks_runs_on_the_local_backend_only(job_dir):
    user = read_command(["python", "train.py", "--deepspeed", "ds.json"])
    with pytest.raises(ConfigError, match="the script starts its own ranks, and --backend slurm starts every rank"):
        Job.build(user.script, user.script_args, [Node("localhost", (0, 1))],
                  TuneOptions(device_memory_bytes=2 * GiB, cpu=True, backend="slurm"), user.launcher)


@pytest.mark.parametrize("command, says", [
    (["--", "mpirun", "train.py"], "zerotune: error: 'mpirun': not a launcher zerotune knows"),
    (["--", "accelerate", "launch", "--config_file", "nope.yaml", "train.py"], "Accelerate config nope.yaml"),
    (["--", "torchrun", "--nnodes", "2", "train.py", "--deepspeed", "ds.json"], "torchrun --nnodes 2"),
    (["--", "torchrun", "--nproc_per_node", "2", "train.py", "--deepspeed", "missing.json"], "missing.json"),
    (["--num_gpus", "3", "--", "torchrun", "--nproc_per_node", "2", "train.py", "--deepspeed", "ds.json"],
     "--num_gpus 3, but the command after '--' (torchrun --nproc_per_node 2) asks for 2: give it once"),
])
def test_bad_commands_exit_2_naming_what_is_wrong_and_create_nothing(job_dir, capsys, command, says):
    before = sorted(p.name for p in job_dir.iterdir())
    assert cli.main(["tune", "--device-memory", "2GiB", "--results-dir", "res", *command]) == 2
    assert says in capsys.readouterr().err
    assert sorted(p.name for p in job_dir.iterdir()) == before


def test_a_double_dash_after_the_script_is_the_scripts_own(job_dir):
    args, command = cli.parse(["tune", "--num_gpus", "2", "train.py", "--deepspeed", "ds.json", "--", "--x"])
    assert command is None and (args.user_script, args.user_args) == ("train.py", ["--deepspeed", "ds.json", "--",
                                                                                   "--x"])
    args, command = cli.parse(["run", "--device-memory", "1GiB", "--", "torchrun", "train.py", "--", "--x"])
    assert command == ["torchrun", "train.py", "--", "--x"] and args.user_script is None
