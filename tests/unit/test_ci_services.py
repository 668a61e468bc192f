"""A test whose service is down skips, naming why; under ZEROTUNE_REQUIRE_SERVICES=1 (CI) it fails instead."""
import subprocess
from pathlib import Path

import pytest

from tests.helpers.services import REQUIRE_ENV, need

ROOT = Path(__file__).resolve().parents[2]


def test_a_service_that_is_down_skips_its_test_or_fails_it_where_ci_requires_it(monkeypatch):
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    need("")  # up: nothing happens
    with pytest.raises(pytest.skip.Exception, match="^Slurm is not up$"):
        need("Slurm is not up")
    monkeypatch.setenv(REQUIRE_ENV, "1")
    need("")
    with pytest.raises(pytest.fail.Exception,
                       match="^ZEROTUNE_REQUIRE_SERVICES=1 and a service this test needs is down: Slurm is not up$"):
        need("Slurm is not up")


def test_ci_requires_the_services_and_runs_the_readmes_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "ZEROTUNE_REQUIRE_SERVICES=1 make test" in ci
    assert "make test" in (ROOT / "README.md").read_text()
    # bash parses it
    assert subprocess.run(["bash", "-n", str(ROOT / ".ci" / "run")]).returncode == 0
