"""zerotune's tests, by package: unit/ (one rule at a time), e2e/ (real DeepSpeed and real processes, backends
included), hostile/ (faults and hostile inputs), bench/ (the benchmarks' own logic); the shared harness is
``tests.helpers.<module>`` and benchmarks/ (the simulator, the fault cases); a test module never imports another
(tests/unit/test_layout.py)."""
