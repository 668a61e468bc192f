"""The fault matrix's cases, which the tests (tests/hostile/test_faults.py, test_hostile_*.py) assert and
benchmarks/fault_matrix.py counts, with what they run on; it imports nothing from tests/.

- standins: a stand-in ``deepspeed`` launcher and rank, and the real CLI driven with them;
- processes: what a run leaves behind (processes, ``/dev/shm`` files);
- fault_cases, hostile_records, hostile_runs, hostile_inputs: the cases, one module per round.
"""
