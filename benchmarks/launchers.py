"""The same job tuned in each launcher's form, warm and ``--cold-launch``: does the launcher change the answer or the
cost of a launch? Real tunings on 2 CPU ranks, ``zerotune tune ... -- <command>`` as a user types it.

Two jobs, each tuned in every form it has:

- ``examples/train_gpt.py`` (the demo's GPT; it takes ``--local_rank`` but reads the rank from the environment, so
  torchrun runs it unchanged), ZeRO 0-1, mbs up to 16: the launcher-style ``deepspeed`` form, and ``torchrun``;
- ``examples/train_hf.py`` (a Hugging Face ``Trainer`` GPT-2 built from a config), ZeRO 1, mbs 2-8, the Trainer's
  ``"auto"`` values: ``deepspeed``, ``torchrun`` and ``accelerate launch --config_file``.

For each tuning it reports the wall (``tuning time`` of its summary), the launches, the mean start-up per launch (the
records' ``startup_s``: launch to the first step's start, the profile run aside) and the answer with its interval.
For the GPT job each answer is then trained end to end, the same way for every form (the ``deepspeed`` launcher, 60
steps, the script's own ``--report-throughput`` over steps 10-60, the median of ``--repeats`` runs): the launchers'
answers compared as a user would experience them.

    OMP_NUM_THREADS=1 python -m benchmarks.launchers [--only gpt|hf] [--modes warm,cold] [--repeats 3]

Prints one table and writes benchmarks/results/launchers.json (``launchers_gpt.json`` with ``--only gpt``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GPT_ARGS = ["--steps", "30"]
HF_ARGS = ["--n_layer", "2", "--n_embd", "128", "--seq_len", "64", "--output_dir", "out", "--max_steps", "30",
           "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--per_device_train_batch_size",
           "2"]
ACCELERATE_YAML = ("compute_environment: LOCAL_MACHINE\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
                   "distributed_type: DEEPSPEED\nmachine_rank: 0\nnum_machines: 1\nnum_processes: 2\nuse_cpu: false\n")


def jobs() -> dict[str, tuple[dict, dict[str, list[str]]]]:
    """job -> (its ds_config, form -> the words after ``zerotune tune [options]``)."""
    gpt_script, hf_script = str(ROOT / "examples" / "train_gpt.py"), str(ROOT / "examples" / "train_hf.py")
    gpt = json.loads((ROOT / "examples" / "ds_config.json").read_text())
    gpt["zero_optimization"]["stage"] = [0, 1]
    gpt["autotuning"].update(start_profile_step=3, end_profile_step=8, max_train_micro_batch_size_per_gpu=16)
    hf = json.loads((ROOT / "examples" / "ds_config_hf.json").read_text())
    hf["zero_optimization"]["stage"] = 1
    hf["autotuning"].update(start_profile_step=3, end_profile_step=8, min_train_micro_batch_size_per_gpu=2,
                            max_train_micro_batch_size_per_gpu=8, num_tuning_micro_batch_sizes=2)
    torchrun = [str(BIN / "torchrun"), "--nproc_per_node", "2"]
    return {
        "gpt": (gpt, {"deepspeed": ["--num_gpus", "2", gpt_script, *GPT_ARGS, "--deepspeed_config", "ds.json"],
                      "torchrun": ["--", *torchrun, gpt_script, *GPT_ARGS, "--deepspeed_config", "ds.json"]}),
        "hf": (hf, {"deepspeed": ["--num_gpus", "2", hf_script, *HF_ARGS, "--deepspeed", "ds.json"],
                    "torchrun": ["--", *torchrun, hf_script, *HF_ARGS, "--deepspeed", "ds.json"],
                    "accelerate": ["--", str(BIN / "accelerate"), "launch", "--config_file", "zero.yaml", hf_script,
                                   *HF_ARGS]}),
    }


def tune(work: Path, config: dict, words: list[str], warm: bool) -> dict:
    """One tuning in ``work``: its figures."""
    work.mkdir(parents=True)
    (work / "ds.json").write_text(json.dumps(config))
    (work / "zero.yaml").write_text(ACCELERATE_YAML)
    options = ["--device-memory", "6GiB", "--results-dir", "results", "--timeout", "300",
               *([] if warm else ["--cold-launch"])]
    proc = subprocess.run([sys.executable, "-m", "zerotune", "tune", *options, *words], cwd=work, capture_output=True,
                          text=True, timeout=1800)
    records = [json.loads(p.read_text()) for p in sorted((work / "results" / "exps").glob("*/exp.json"))]
    summary = (work / "results" / "summary.txt").read_text() if (work / "results" / "summary.txt").exists() else ""
    wall = re.search(r"tuning time ([\d.]+) s", summary)
    answer = re.search(r"Optimal: (\S+) .*?throughput ([\d.]+) ±([\d.]+)%", summary)
    startups = [r["startup_s"] for r in records if r.get("startup_s") is not None and r["kind"] != "profile"]
    optimal = work / "results" / "ds_config_optimal.json"
    return {"exit": proc.returncode, "optimal": json.loads(optimal.read_text()) if optimal.exists() else None, "wall_s": float(wall.group(1)) if wall else None, "launches": len(records),
            "launched": sorted({r["launch"] for r in records}), "startup_s": statistics.mean(startups) if startups
            else None, "answer": answer.group(1) if answer else None,
            "samples_per_s": float(answer.group(2)) if answer else None,
            "half_width_pct": float(answer.group(3)) if answer else None}


def end_to_end(work: Path, config: dict, repeats: int) -> float:
    """The median samples/s of ``repeats`` 60-step runs of the GPT job with ``config`` (its steps 10-60)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "answer.json").write_text(json.dumps(config))
    rates = []
    for i in range(repeats):
        out = work / f"throughput{i}.json"
        subprocess.run([str(BIN / "deepspeed"), "--num_gpus", "2", str(ROOT / "examples" / "train_gpt.py"), "--steps",
                        "60", "--warmup-steps", "10", "--report-throughput", str(out), "--deepspeed_config",
                        str(work / "answer.json")], cwd=work, capture_output=True, timeout=900,
                       env={**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "2"})
        if out.exists():
            rates.append(json.loads(out.read_text())["samples_per_s"])
    return statistics.median(rates) if rates else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("gpt", "hf"))
    parser.add_argument("--modes", default="warm,cold", help="warm, cold or both (warm,cold)")
    parser.add_argument("--repeats", type=int, default=3, help="end-to-end runs of each GPT answer")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="zt-launchers-") as tmp:
        for job, (config, forms) in jobs().items():
            if args.only and job != args.only:
                continue
            for mode in args.modes.split(","):
                for form, words in forms.items():
                    row = {"job": job, "form": form, "mode": mode,
                           **tune(Path(tmp) / f"{job}_{form}_{mode}", config, words, mode == "warm")}
                    if job == "gpt" and row["optimal"] is not None:
                        row["end_to_end"] = end_to_end(Path(tmp) / f"e2e_{form}_{mode}", row["optimal"], args.repeats)
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "optimal"}), flush=True)
    out = ROOT / "benchmarks" / "results" / f"launchers{'_' + args.only if args.only else ''}.json"
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\n{'job':4} {'form':10} {'mode':4} {'exit':>4} {'wall s':>7} {'launches':>8} {'start-up s':>10} "
          f"{'e2e /s':>7}  answer")
    for r in rows:
        startup = f"{r['startup_s']:.2f}" if r["startup_s"] is not None else "-"
        answer = f"{r['answer']} {r['samples_per_s']} ±{r['half_width_pct']}%" if r["answer"] else "-"
        e2e = f"{r['end_to_end']:.2f}" if "end_to_end" in r else "-"
        print(f"{r['job']:4} {r['form']:10} {r['mode']:4} {r['exit']:>4} {r['wall_s'] or '-':>7} {r['launches']:>8} "
              f"{startup:>10} {e2e:>7}  {answer}")


if __name__ == "__main__":
    main()
