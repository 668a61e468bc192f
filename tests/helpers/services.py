"""The services some tests need (Slurm, the two-node cluster, Chromium): a test whose service is down skips,
naming why, or, where ``ZEROTUNE_REQUIRE_SERVICES=1`` (CI: `.ci/run`), fails, so a service that did not start
cannot pass a run by skipping its tests."""
import os

import pytest

REQUIRE_ENV = "ZEROTUNE_REQUIRE_SERVICES"


def required() -> bool:
    """Whether a service that is down fails its tests (``ZEROTUNE_REQUIRE_SERVICES`` set to 1) instead of skipping
    them."""
    return os.environ.get(REQUIRE_ENV, "") == "1"


def need(down: str) -> None:
    """Within a test or fixture: nothing where ``down`` is "" (the service answers); else skip with ``down`` (why it
    is down, and what starts it), or fail with it where :func:`required`."""
    if not down:
        return
    if required():
        pytest.fail(f"{REQUIRE_ENV}=1 and a service this test needs is down: {down}", pytrace=False)
    pytest.skip(down)
