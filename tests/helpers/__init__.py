"""The harness tests share, one module per concept; a test module imports from here (or from benchmarks/),
never from another test module (tests/unit/test_layout.py holds that).

- tiny: the tiny example (examples/train_gpt.py at its smallest) and its ds_configs;
- cluster_env: the environment Slurm and the two-node namespaces give the ranks;
- services: a test whose service (Slurm, two nodes, Chromium) is down skips, or fails in CI;
- simulated: the whole tuner on the SIMULATED cluster (benchmarks/simcluster);
- probe: the probe's profile record on a stand-in engine, and the models it counts;
- cli_inputs: a valid command line around one bad value, and bad files by class.
The fault matrix's cases and stand-ins, which benchmarks/fault_matrix.py runs too, are benchmarks/faults/.
"""
