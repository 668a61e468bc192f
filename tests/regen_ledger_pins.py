"""Regenerate tests/test_ledgers.py's PINS and BATCH_PINS from the current code (SIMULATED cluster).

    python -m tests.regen_ledger_pins            # print which pins changed (case, launches before/after, answers)
    python -m tests.regen_ledger_pins --write    # and rewrite the two dicts in tests/test_ledgers.py

A change to what the tuner runs or how it decides moves the pins on purpose: regenerate, read the
changed cases (more or fewer launches, another answer) and say why in test_ledgers' history comment.
Run from the repository root (``tests`` and ``benchmarks`` are packages there).
"""
import re
import sys
import tempfile
from pathlib import Path

from tests import test_ledgers as T  # the pins it compares and rewrites
from tests.helpers.simulated import tune_simulated

ROOT = Path(__file__).resolve().parents[1]

def block(entries, indent):
    pad = " " * indent
    out = []
    for k, v in entries:
        out.append(f"{pad}{k!r}: {{")
        for key in v:
            if key == "ledger":
                out.append(f"{pad}    'ledger': [")
                out += [f"{pad}        {row!r}," for row in v["ledger"]]
                out.append(f"{pad}    ],")
            else:
                out.append(f"{pad}    {key!r}: {v[key]!r},")
        out.append(f"{pad}}},")
    return "\n".join(out)

src = (ROOT / "tests/test_ledgers.py").read_text()
changed = []
new_pins = []
for case, pin in T.PINS.items():
    with tempfile.TemporaryDirectory() as d:
        ledger, decisions, answer = tune_simulated(Path(d), *case)
    new = {"ledger": ledger, "decisions": decisions, "answer": answer}
    if new != {k: pin[k] for k in new}:
        changed.append((case, len(pin["ledger"]), len(ledger), pin["answer"][:3], answer[:3]))
    new_pins.append((case, new))
new_batch = []
for name, pin in T.BATCH_PINS.items():
    with tempfile.TemporaryDirectory() as d:
        ledger, decisions, answer = tune_simulated(Path(d), pin["scenario"], True, "all", pin["overrides"])
    new = {"scenario": pin["scenario"], "overrides": pin["overrides"], "ledger": ledger, "decisions": decisions, "answer": answer}
    if new != pin:
        changed.append((name, len(pin["ledger"]), len(ledger), pin["answer"][:3], answer[:3]))
    new_batch.append((name, new))
src = re.sub(r"(PINS = \{\n).*?(\n\}\n\n\n@pytest)", lambda m: m.group(1) + block(new_pins, 4) + m.group(2), src, count=1, flags=re.S)
src = re.sub(r"(BATCH_PINS = \{\n).*?(\n\}\n\n\n@pytest)", lambda m: m.group(1) + block(new_batch, 4) + m.group(2), src, count=1, flags=re.S)
if "--write" in sys.argv:
    (ROOT / "tests/test_ledgers.py").write_text(src)
for c in changed:
    print("changed:", c)
