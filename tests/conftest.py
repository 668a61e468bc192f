"""Fixtures any test module may ask for by name. The shared harness is :mod:`tests.helpers`; its asserts are
rewritten as a test module's are, so a failing check there reports its values."""
import pytest

pytest.register_assert_rewrite("tests.helpers")


@pytest.fixture
def one_thread_per_rank(monkeypatch):
    """``OMP_NUM_THREADS=1`` for the test and the ranks it starts (2 ranks on 2 cores). A module that launches ranks
    asks for it in every test: ``pytestmark = pytest.mark.usefixtures("one_thread_per_rank")``."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
