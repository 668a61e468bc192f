"""The harness tests share, one module per concept; a test module imports from here, never from another test
module (tests/test_layout.py holds that).

- :mod:`tests.helpers.tiny`: the tiny example (examples/train_gpt.py at its smallest) and its ds_configs;
- :mod:`tests.helpers.standins`: a stand-in ``deepspeed`` launcher and rank, and the real CLI driven with them;
- :mod:`tests.helpers.processes`: what a run leaves behind (processes, ``/dev/shm`` files);
- :mod:`tests.helpers.cluster_env`: the environment Slurm and the two-node namespaces give the ranks;
- :mod:`tests.helpers.services`: a test whose service (Slurm, two nodes, Chromium) is down skips, or fails in CI;
- :mod:`tests.helpers.simulated`: the whole tuner on the SIMULATED cluster (benchmarks/simcluster);
- :mod:`tests.helpers.probe`: the probe's profile record on a stand-in engine, and the models it counts;
- :mod:`tests.helpers.cli_inputs`: a valid command line around one bad value, and bad files by class;
- :mod:`tests.helpers.fault_cases`, :mod:`~tests.helpers.hostile_records`, :mod:`~tests.helpers.hostile_runs`,
  :mod:`~tests.helpers.hostile_inputs`: the fault matrix's cases, which the tests and
  benchmarks/fault_matrix.py both run.
"""
