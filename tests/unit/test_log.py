"""zerotune's log (zerotune.report.log): each module's logger, shown on the tuner's console, --quiet and --verbose."""
import logging

import pytest

from tests.helpers.tiny import SCRIPT, write_dry_run_config
from zerotune import cli


@pytest.fixture(autouse=True)
def restore_levels():
    """The CLI sets the ``zerotune`` logger's level for the process: each test starts and ends with none."""
    names = ("zerotune", "zerotune.strategy.tuning")
    yield
    for name in names:
        logging.getLogger(name).setLevel(logging.NOTSET)


def dry_run(tmp_path, *flags) -> str:
    argv = ["tune", "--num_gpus", "2", "--device-memory", "2.5GiB", "--dry-run", *flags,
            "--results-dir", str(tmp_path / "r"), SCRIPT,
            "--deepspeed_config", str(write_dry_run_config(tmp_path / "ds.json"))]
    assert cli.main(argv) == 0
    return argv


def test_the_decisions_are_logged_on_the_console_and_quiet_silences_them(tmp_path, capsys):
    dry_run(tmp_path)
    err = capsys.readouterr().err
    assert "memory model: ZeRO stage 0: largest mbs estimated to fit 8" in err  # zerotune.strategy.tuning
    assert "gas phase ZeRO stage 0 at mbs=8" in err  # zerotune.strategy.gas_phase
    dry_run(tmp_path, "--quiet")
    err = capsys.readouterr().err
    assert "memory model:" not in err and "gas phase" not in err
    with pytest.raises(SystemExit):  # one or the other
        dry_run(tmp_path, "--quiet", "--verbose")


def test_one_module_is_silenced_by_its_logger_name(tmp_path, capsys):
    logging.getLogger("zerotune.strategy.tuning").setLevel(logging.WARNING)
    dry_run(tmp_path, "--verbose")
    err = capsys.readouterr().err
    assert "memory model: ZeRO stage 0" not in err
    assert "gas phase ZeRO stage 0 at mbs=8" in err
