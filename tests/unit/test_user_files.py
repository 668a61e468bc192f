"""Every file the user names is read bounded, and any failure is exit status 2 naming the file and what it must be
(issue 39, item 5; :mod:`zerotune.core.user_files`).

The readers: the ds_config (``zerotune tune``), a hostfile, DeepSpeed's env file, and ``zerotune estimate``'s
``--hf-config``, ``--deepspeed`` and ``--profile``. Each runs through the real CLI in-process on real files of every
bad class: special files (a directory, a FIFO, a socket, ``/dev/zero`` and a link to it), a file one byte over
:data:`~zerotune.core.user_files.MAX_FILE_BYTES`, a missing file, bytes that are not UTF-8, JSON one level too deep
and 100,000 levels deep, a number Python does not convert, invalid JSON and JSON that is not an object. Each test
asserts the exact message, exit status 2 and that nothing was written.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.helpers.cli_inputs import CONTENT, NOT_REGULAR, make_bad_files
from zerotune import cli
from zerotune.core import user_files
from zerotune.core.errors import ConfigError
from zerotune.core.user_files import MAX_FILE_BYTES, MAX_JSON_DEPTH
from zerotune.deepspeed.config import CONFIG_RULE
from zerotune.deepspeed.rank_env import user_env_texts


@pytest.fixture
def files():
    root = make_bad_files(Path(tempfile.mkdtemp(prefix="zt-")))
    yield root
    shutil.rmtree(root)


def path_of(root: Path, kind: str) -> Path:
    return Path("/dev/zero") if kind == "dev-zero" else root / kind


def tree(root: Path) -> list:
    return sorted((str(p.relative_to(root)), p.is_dir()) for p in root.rglob("*"))


def run(root: Path, argv: list[str], capsys) -> str:
    """``zerotune ARGV`` in-process: asserts exit status 2 and that nothing was written; its stderr."""
    before = tree(root)
    assert cli.main(argv) == 2
    assert tree(root) == before, "something was written"
    assert not (root / "results").exists()
    return capsys.readouterr().err


def tune_argv(root: Path, *flags: str, config: Path | None = None) -> list[str]:
    """A real ``zerotune tune`` (no dry run: exit 2 must come before anything is written)."""
    return ["tune", *flags, "--device-memory", "2GiB", "--results-dir", str(root / "results"), str(root / "train.py"),
            "--deepspeed_config", str(config or root / "ds.json")]


def estimate_argv(*flags: str) -> list[str]:
    return ["estimate", *flags, "--device-memory", "2GiB"]


JSON_READERS = {  # reader: (argv for the file's path, its label, its rule)
    "ds_config": (lambda root, p: tune_argv(root, "--num_gpus", "1", config=p), lambda p: str(p), CONFIG_RULE),
    "--hf-config": (lambda root, p: estimate_argv("--hf-config", str(p)),
                    lambda p: f"--hf-config {p}" + (": config.json" if p.is_dir() else ""),
                    "expected a Hugging Face config.json"),
    "--deepspeed": (lambda root, p: estimate_argv("--num-params", "1e9", "--deepspeed", str(p)),
                    lambda p: f"--deepspeed {p}", CONFIG_RULE),
    "--profile": (lambda root, p: estimate_argv("--profile", str(p)),
                  lambda p: f"--profile {p}" + (": model_info.json" if p.is_dir() else ""),
                  "expected a profile run's directory or its model_info.json"),
}


@pytest.mark.parametrize("kind", [*NOT_REGULAR, *CONTENT])
@pytest.mark.parametrize("reader", JSON_READERS)
def test_a_json_file_of_any_bad_class_is_exit_2_naming_it(files, capsys, reader, kind):
    argv, label, rule = JSON_READERS[reader]
    path = path_of(files, kind)
    err = run(files, argv(files, path), capsys)
    assert err == f"zerotune: error: {label(path)}{NOT_REGULAR.get(kind) or CONTENT[kind]}; {rule}\n"


@pytest.mark.parametrize("kind", NOT_REGULAR)
def test_a_hostfile_that_is_not_a_regular_file_or_too_large_is_exit_2_naming_it(files, capsys, kind):
    path = path_of(files, kind)
    err = run(files, tune_argv(files, "--hostfile", str(path)), capsys)
    assert err == f"zerotune: error: hostfile {path}{NOT_REGULAR[kind]}; expected lines like 'worker-0 slots=8'\n"


@pytest.mark.parametrize("kind", ["not UTF-8", "one byte over"])
def test_deepspeeds_env_file_that_cannot_be_read_is_exit_2_before_a_multi_node_tuning(files, capsys, monkeypatch,
                                                                                       kind):
    """DeepSpeed's runner reads its env file at every multi-node launch: the tuning checks it first."""
    (files / "hosts").write_text("worker-1 slots=1\nworker-2 slots=1\n")
    monkeypatch.setenv("DS_ENV_FILE", str(files / kind))
    err = run(files, tune_argv(files, "--hostfile", str(files / "hosts")), capsys)
    what = NOT_REGULAR.get(kind) or CONTENT[kind]
    assert err == f"zerotune: error: DeepSpeed env file {files / kind}{what}; expected NAME=VALUE lines, UTF-8\n"


def test_deepspeeds_env_files_are_read_where_they_are_regular_files_as_the_runner_reads_them(files):
    (files / "env").write_text("NCCL_DEBUG=INFO\n")
    assert user_env_texts({"DS_ENV_FILE": str(files / "env")}, cwd=files) == ["NCCL_DEBUG=INFO\n"]
    for special in ("fifo", "socket", "link-to-dev-zero", "directory"):  # the runner's os.path.isfile skips them
        assert user_env_texts({"DS_ENV_FILE": str(files / special)}, cwd=files) == []


def test_json_depth_counts_arrays_and_objects_without_recursing():
    assert [user_files.json_depth(v) for v in (5, [], {"a": []}, [1, [2, {"b": [3]}]])] == [0, 1, 2, 4]
    deep: list = []
    for _ in range(100_000):  # far deeper than Python's recursion limit
        deep = [deep]
    assert user_files.json_depth(deep) == MAX_JSON_DEPTH + 1  # counting stops past the limit
    assert user_files.json_depth(deep, limit=10**6) == 100_001


def test_json_up_to_the_depth_bound_is_read_and_one_level_more_is_not():
    assert user_files.loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None
    with pytest.raises(user_files.JSONTooDeep, match="^JSON nested deeper than the 64 levels zerotune reads$"):
        user_files.loads("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))


def test_a_file_of_exactly_the_size_bound_is_read(files):
    (files / "full").write_bytes(b"x" * MAX_FILE_BYTES)
    assert len(user_files.read_text(files / "full", "full", "rule")) == MAX_FILE_BYTES


def test_check_file_leaves_a_missing_path_to_its_reader(files):
    user_files.check_file(files / "nope", "hostfile nope", "rule")
    with pytest.raises(ConfigError, match=r"^hostfile f: a FIFO \(named pipe\), not a regular file; rule$"):
        user_files.check_file(files / "fifo", "hostfile f", "rule")


@pytest.mark.parametrize("kind", ["link-to-dev-zero", "fifo", "100000 deep", "not UTF-8"])
def test_a_profile_runs_probe_record_that_is_no_record_is_ignored_not_a_traceback(files, capsys, kind):
    """``estimate --profile DIR`` reads the probe's activations record beside ``model_info.json``: a record that
    cannot be read is no record, as for a profile run whose probe wrote none."""
    profile = files / "profile"
    profile.mkdir()
    (profile / "model_info.json").write_text(json.dumps({"num_params": 1_000_000, "activation_mem_per_gpu": 1000}))
    record = profile / "activations.json"
    if kind in ("link-to-dev-zero", "fifo"):
        record.symlink_to(files / kind)
    else:
        shutil.copyfile(files / kind, record)
    assert cli.main(estimate_argv("--profile", str(profile), "--json")) == 0
    assert json.loads(capsys.readouterr().out)["activation_bytes_per_sample"] == 1000
