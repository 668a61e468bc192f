"""Regenerate the SIMULATED ledger pins (tests/data/ledger_pins.json) from the current code.

    python -m tests.regen_ledger_pins            # print which pins changed (case, launches before/after, answers)
    python -m tests.regen_ledger_pins --write    # and rewrite tests/data/ledger_pins.json

A change to what the tuner runs or how it decides moves the pins on purpose: regenerate, read the
changed cases (more or fewer launches, another answer) and say why in test_ledgers' history comment.
Run from the repository root (``tests`` and ``benchmarks`` are packages there).
"""
import sys
import tempfile
from pathlib import Path

from tests.helpers import ledger_pins
from tests.helpers.ledger_pins import plain
from tests.helpers.simulated import tune_simulated


def main() -> None:
    pins, batch_pins = ledger_pins.load()
    changed, new_pins, new_batch = [], [], []
    for case, pin in pins.items():
        with tempfile.TemporaryDirectory() as d:
            ledger, decisions, answer = tune_simulated(Path(d), *case)
        new = plain({"ledger": ledger, "decisions": decisions, "answer": answer})
        if new != {k: pin[k] for k in new}:
            changed.append((case, len(pin["ledger"]), len(ledger), pin["answer"][:3], new["answer"][:3]))
        new_pins.append((case, new))
    for name, pin in batch_pins.items():
        with tempfile.TemporaryDirectory() as d:
            ledger, decisions, answer = tune_simulated(Path(d), pin["scenario"], True, "all", pin["overrides"])
        new = plain({"scenario": pin["scenario"], "overrides": pin["overrides"], "ledger": ledger,
                     "decisions": decisions, "answer": answer})
        if new != pin:
            changed.append((name, len(pin["ledger"]), len(ledger), pin["answer"][:3], new["answer"][:3]))
        new_batch.append((name, new))
    if "--write" in sys.argv:
        ledger_pins.write(new_pins, new_batch)
    for c in changed:
        print("changed:", c)


if __name__ == "__main__":
    main()
