"""The SIMULATED ledger pins' data file (``tests/data/ledger_pins.json``): read by tests/unit/test_ledgers.py, written by
tests/regen_ledger_pins.py. JSON keeps lists where the tuner's rows are tuples: :func:`plain` gives a tuning's rows
the same shape before they are compared."""
import json
from pathlib import Path
from typing import Any

PIN_FILE = Path(__file__).resolve().parents[1] / "data" / "ledger_pins.json"


def plain(value: Any) -> Any:
    """``value`` as the pin file holds it (tuples as lists)."""
    return json.loads(json.dumps(value))


def case_key(case: list) -> tuple:
    """A pin's case (scenario, fast, stages) as the test's parameter: stages a tuple or ``"all"``."""
    index, fast, stages = case
    return index, fast, tuple(stages) if isinstance(stages, list) else stages


def load() -> tuple[dict[tuple, dict], dict[str, dict]]:
    """(case -> pin, batch-case name -> pin) from :data:`PIN_FILE`."""
    data = json.loads(PIN_FILE.read_text())
    return {case_key(p["case"]): p for p in data["pins"]}, data["batch_pins"]


def write(pins: list[tuple[tuple, dict]], batch_pins: list[tuple[str, dict]]) -> None:
    """Write :data:`PIN_FILE`: one ledger row per line, so a moved launch is one line of the diff."""
    def entry(fields: dict, indent: str) -> str:
        lines = []
        for key, value in fields.items():
            if key == "ledger":
                rows = ",\n".join(f"{indent}    {json.dumps(row)}" for row in value)
                lines.append(f'{indent}"ledger": [\n{rows}\n{indent}]')
            else:
                lines.append(f"{indent}{json.dumps(key)}: {json.dumps(value)}")
        return ",\n".join(lines)

    cases = ",\n".join("    {\n" + entry({"case": list(case), **plain(pin)}, "      ") + "\n    }" for case, pin in pins)
    batches = ",\n".join(f"    {json.dumps(name)}: {{\n" + entry(plain(pin), "      ") + "\n    }"
                         for name, pin in batch_pins)
    PIN_FILE.parent.mkdir(parents=True, exist_ok=True)
    PIN_FILE.write_text('{\n  "pins": [\n' + cases + '\n  ],\n  "batch_pins": {\n' + batches + "\n  }\n}\n")
