"""Hostile user input to the CLI, for tests/unit/test_arguments.py, tests/unit/test_user_files.py and tests/hostile/test_fuzz.py: every
option that takes a value, a valid command line around one bad value, run in-process with nothing written, and bad
files by class."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import socket
from pathlib import Path

from zerotune import cli
from zerotune.core.user_files import MAX_FILE_BYTES, MAX_JSON_DEPTH

CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
          "autotuning": {"model_info": {"num_params": 1000}}}


def value_actions() -> list[tuple[str, argparse.Action]]:
    """(command, action) for every option and positional argument that takes a value, of every command."""
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    return [(command, action) for command, sub in commands.items() for action in sub._actions
            if action.nargs not in (0, argparse.REMAINDER)]


def files(tmp: Path) -> Path:
    """A valid config, a script, a results dir for ``report`` and a plain file, in ``tmp``; the config's path."""
    (tmp / "ds.json").write_text(json.dumps(CONFIG))
    (tmp / "train.py").write_text("print('never run')\n")
    (tmp / "afile").write_text("a file\n")
    (tmp / "done").mkdir(exist_ok=True)
    return tmp / "ds.json"


def full_argv(tmp: Path, command: str, flags: list[str], positional: str | None = None,
              config: str | None = None) -> list[str]:
    """``command`` with ``flags`` and what it needs besides to be valid (the script and config, a budget, a results
    dir, ``--num_gpus 1`` where no ``--include`` or ``--hostfile`` is given); ``positional`` replaces the first
    positional argument (the script, the results dir of ``report``), ``config`` the ds_config's path."""
    given = {f.split("=", 1)[0] for f in flags}  # --flag VALUE or --flag=VALUE
    if command == "estimate":
        model = [] if {"--hf-config", "--profile", "--num-params"} & given else ["--num-params", "1e9"]
        return ["estimate", *flags, *model, *([] if "--device-memory" in given else ["--device-memory", "2GiB"])]
    if command == "report":
        return ["report", *flags, str(tmp / "done") if positional is None else positional]
    gpus = [] if {"--num_gpus", "--include", "--hostfile"} & given else ["--num_gpus", "1"]
    memory = [] if "--device-memory" in given else ["--device-memory", "2GiB"]
    results = [] if "--results-dir" in given else ["--results-dir", str(tmp / "results")]
    script = str(tmp / "train.py") if positional is None else positional
    return [command, *flags, *gpus, *memory, *results, script, "--deepspeed_config",
            str(tmp / "ds.json") if config is None else config]


def tree(tmp: Path) -> list:
    return sorted((str(p.relative_to(tmp)), p.stat().st_mtime_ns if p.is_file() else 0) for p in tmp.rglob("*"))


def cli_exit(tmp: Path, argv: list[str]) -> tuple[int, str]:
    """``zerotune ARGV`` in-process from ``tmp``: (its exit status, argparse's included; its stderr); asserts that
    nothing in ``tmp`` was created or changed and that no traceback was printed."""
    before, err = tree(tmp), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse: a value its type refuses, after the usage line
            code = e.code
    assert tree(tmp) == before, f"{argv} wrote {sorted(set(tree(tmp)) - set(before))}"
    assert "Traceback" not in err.getvalue()
    return code, err.getvalue()


NOT_REGULAR = {"directory": ": a directory, not a regular file", "fifo": ": a FIFO (named pipe), not a regular file",
               "socket": ": a socket, not a regular file", "dev-zero": ": a character device, not a regular file",
               "link-to-dev-zero": ": a character device, not a regular file",
               "one byte over": f": {MAX_FILE_BYTES + 1} bytes, more than the 4.00 MiB zerotune reads"}
"""Kinds of file no reader opens for reading, and what the message says after the file's label."""
CONTENT = {"missing": ": cannot read it (No such file or directory)",
           "not UTF-8": ": not UTF-8 (byte 0xe9 at offset 10)",
           f"{MAX_JSON_DEPTH + 1} deep": ": JSON nested deeper than the 64 levels zerotune reads",
           "100000 deep": ": JSON nested deeper than the 64 levels zerotune reads",
           "5000 digits": ": a JSON number of more than 4300 digits",
           "invalid JSON": ":1:7: invalid JSON: Expecting value",
           "JSON array": ": a JSON array, not an object",
           "key twice": ": the key 'stage' appears twice in one object (JSON would keep the last without a word; "
                        "DeepSpeed refuses the file)"}
"""Files a JSON reader opens and refuses, and what the message says after the file's label."""


def make_bad_files(root: Path) -> Path:
    """Every bad file by kind (:data:`NOT_REGULAR`, :data:`CONTENT`; ``dev-zero`` is ``/dev/zero`` itself, see
    ``path_of`` in tests/unit/test_user_files.py) in ``root``, which must be short (a socket's path is at most 107
    bytes), with a training script and a valid ``ds.json``; ``root``."""
    root.mkdir(exist_ok=True)
    (root / "train.py").write_text("print('never run')\n")
    for name in ("directory", "directory/config.json", "directory/model_info.json"):  # readers that take a dir too
        (root / name).mkdir(parents=True)
    os.mkfifo(root / "fifo")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(root / "socket"))
    (root / "link-to-dev-zero").symlink_to("/dev/zero")
    (root / "one byte over").write_bytes(b" " * (MAX_FILE_BYTES + 1))
    deep = MAX_JSON_DEPTH  # inside the top object: one level more than allowed
    for name, text in (("not UTF-8", b'{"a": "caf\xe9"}'), (f"{MAX_JSON_DEPTH + 1} deep",
                       ('{"a": ' + "[" * deep + "]" * deep + "}").encode()), ("100000 deep", b"[" * 100000),
                       ("5000 digits", b'{"a": ' + b"9" * 5000 + b"}"), ("invalid JSON", b'{"a": }'),
                       ("JSON array", b"[1]"), ("key twice", b'{"a": {"stage": 1, "stage": 3}}')):
        (root / name).write_bytes(text)
    (root / "ds.json").write_text(json.dumps(CONFIG))
    return root
