"""Hostile inputs, records and runs, rank faults and the fuzzer: nothing lost, no traceback, a clear exit status."""
