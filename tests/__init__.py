"""zerotune's tests, a package: tests and benchmarks import the shared harness as ``tests.helpers.<module>``; a
test module never imports another (tests/test_layout.py)."""
