"""The command line: zerotune's options, then ``--`` and the user's own training command; or launcher-style like
``deepspeed``: options first, then the script and its args (the same as ``-- deepspeed ...``).

    zerotune tune [--device-memory 3GiB] [...] -- torchrun --nproc_per_node 2 train.py --deepspeed ds.json
    zerotune tune [--hostfile F] [--include ...] [--num_gpus N] [--device-memory 3GiB] SCRIPT [ARGS...]
    zerotune run  ...same...   # tune, then train with the winning config (tune --dry-run [--json]: launch nothing)
    zerotune estimate --num-params 13e9 --num_gpus 8 --num_nodes 2 --device-memory 40GiB   # what-if, runs nothing
    zerotune report RESULTS_DIR [--train-samples N] [--cost-per-device-hour 2.5]   # report.html, results.csv/json
Exit status: 0 success, 1 no experiment succeeded, 2 bad input, 3 training failed, 128 + the signal (`main`).
"""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from dataclasses import fields
from typing import Any

from rich.console import Console

from zerotune.autotuner import Autotuner, Interrupted, TuneOptions
from zerotune.core import user_files
from zerotune.core.arguments import MAX_COUNT, positive_number, reject_empty, whole
from zerotune.core.errors import ConfigError, TuningFailed
from zerotune.core.noise import DEFAULT_PRECISION
from zerotune.core.units import parse_bytes
from zerotune.inputs.job import cuda_available
from zerotune.inputs.options import LongestOptions
from zerotune.inputs.variables import parse_cli_variable
from zerotune.launchers.base import Launcher
from zerotune.launchers.command import UserCommand, read_command
from zerotune.model import estimate
from zerotune.report import publish
from zerotune.report.log import set_verbosity
from zerotune.run.backends import BACKENDS, backend_nodes
from zerotune.run.resources import select_resources, slots_named

TRAINING_FAILED = 3
"""``zerotune run``'s exit status when the training it launched with the optimal config failed: the
training's own status (2, or 247 from DeepSpeed's launcher for a rank killed by SIGKILL) would read as
zerotune's "bad input" or be lost; `training_status` says it in a line."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerotune", description="Find the fastest DeepSpeed configuration for a "
                                     "training script, with real experiments.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("tune", "tune and write the optimal config"),
                            ("run", "tune, then launch training with the optimal config")):
        p = sub.add_parser(name, help=help_text)
        _launcher_options(p)
        z = p.add_argument_group("zerotune options")
        z.add_argument("--results-dir", default=None, help="results dir (default: autotuning.results_dir)")
        z.add_argument("--device-memory", default=None,
                       help="per-rank memory budget, e.g. 3GiB (required on CPU; read from the device on CUDA)")
        z.add_argument("--host-memory", default=None,
                       help="host memory per node that offloaded optimizer states and parameters must fit in, e.g. "
                            "512GiB (default: this machine's, when every node is this machine; on CPU ranks offload "
                            "counts against --device-memory)")
        z.add_argument("--no-savers", dest="savers", action="store_false",
                       help="never try activation checkpointing or offload beyond what the config says")
        z.add_argument("--nvme-path", default=None, metavar="DIR",
                       help="a directory on local NVMe: where the host cannot hold what offload moves, offload there")
        z.add_argument("--timeout", dest="timeout_s", metavar="TIMEOUT", type=float, default=None, help="seconds per experiment before it is killed")
        z.add_argument("--hang-timeout", dest="hang_timeout_s", metavar="HANG_TIMEOUT", type=float, default=None,
                       help="kill an experiment whose output has not changed for this many seconds")
        z.add_argument("--cold-launch", dest="warm", action="store_false",
                       help="start every experiment's ranks through the deepspeed launcher, as a fresh process each "
                            "(default: forked from a server that imported torch, DeepSpeed and the script's imports "
                            "once per tuning, on the local backend's one node)")
        z.add_argument("--overwrite", action="store_true", default=None, help="discard earlier results and start fresh")
        z.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                       help="candidates of the ds_config's $NAME placeholders, as JSON (a list is a list of candidates, "
                            "e.g. --var RBS='[5e7, 5e8]'); over autotuning.variables; repeatable")
        z.add_argument("--precision", type=float, default=DEFAULT_PRECISION,
                       help="end an experiment once its metric's 95%% interval is within this relative half-width "
                            f"(default {DEFAULT_PRECISION:g}, i.e. ±{DEFAULT_PRECISION * 100:g}%%)")
        z.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                       help="run every experiment to end_profile_step (no early end when its metric is known or "
                            "cannot beat the best)")
        z.add_argument("--cpu", action="store_true", default=None,
                       help="run DeepSpeed on CPU even if CUDA is present (DS_ACCELERATOR=cpu in the environment too)")
        z.add_argument("--backend", choices=BACKENDS, default="local",
                       help="where experiments run: 'local' (the deepspeed launcher here), 'ray' (a Ray cluster, "
                            "one placement group per experiment; pip install 'zerotune[ray]') or 'slurm' (inside "
                            "salloc or an sbatch script: one srun job step per experiment on the allocation's nodes)")
        z.add_argument("--address", dest="ray_address", metavar="ADDRESS", default=None,
                       help="with --backend ray: the Ray cluster address, e.g. 10.0.0.1:6379 or auto "
                            "(default: $RAY_ADDRESS, else a new Ray instance on this machine)")
        z.add_argument("--dry-run", action="store_true",
                       help="print every experiment the job may generate (name, stage, mbs, gas, knobs, memory per "
                            "device, fits) and exit without launching anything")
        z.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
        v = z.add_mutually_exclusive_group()
        v.add_argument("--quiet", action="store_true", help="log warnings and errors only (not each decision)")
        v.add_argument("--verbose", action="store_true", help="log debug lines too")
        for add_options in (publish.add_projection_options, _budget_options, _longest_options):
            add_options(p)
        _command_arguments(p)
    estimate.add_parser(sub)
    publish.add_parser(sub)
    reject_empty(parser)
    return parser


def _command_arguments(p: argparse.ArgumentParser) -> None:
    """The training script and its arguments (the launcher-style form; `parse` takes ``-- COMMAND...``)."""
    p.add_argument("user_script", nargs="?", help="the training script (or: -- COMMAND, the command you train with: "
                   "deepspeed, torchrun, accelerate launch, python SCRIPT)")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="its arguments, with --deepspeed_config ds.json")


def _budget_options(p: argparse.ArgumentParser) -> None:
    """``--max-launches`` and ``--max-device-hours``: what a tuning may spend (`zerotune.inputs.budget`)."""
    g = p.add_argument_group("the tuning's budget (then the best of what ran is the answer)")
    g.add_argument("--max-launches", type=whole(2, MAX_COUNT), default=None, metavar="N",
                   help="launch at most N experiments, the profile run included (so at least 2: the profile and one "
                        "run with a reading); then answer with the best of what ran, say what was not decided and by "
                        "how much the answer could be beaten")
    g.add_argument("--max-device-hours", type=positive_number, default=None, metavar="H",
                   help="launch no more experiments once those launched took H device-hours (wall time x devices); "
                        "then answer as with --max-launches")


def _longest_options(p: argparse.ArgumentParser) -> None:
    """``--max-seq-len`` and ``--verify-longest``: the answer at the longest batch (`zerotune.strategy.longest`)."""
    g = p.add_argument_group("the longest batch the training can meet")
    g.add_argument("--max-seq-len", type=whole(1, MAX_COUNT), default=None, metavar="N",
                   help="the longest sequence a training batch holds, tokens: the answer must fit its peak there "
                        "(default: the model's n_positions where the batches' lengths vary, else what the runs saw)")
    g.add_argument("--verify-longest", dest="verify", action="store_true",
                   help="run the answer once more with every batch's token ids padded to the longest length")


def _launcher_options(p: argparse.ArgumentParser) -> None:
    """The options ``tune`` and ``run`` share with the ``deepspeed`` launcher."""
    g = p.add_argument_group("launcher options (as the deepspeed launcher)")
    g.add_argument("--hostfile", default=None, help="DeepSpeed hostfile ('worker-0 slots=8' per line)")
    g.add_argument("--include", default=None, help="e.g. 'worker-0:0,1@worker-1'")
    g.add_argument("--exclude", default=None, help="e.g. 'worker-1:0'")
    g.add_argument("--num_nodes", type=whole(-1, MAX_COUNT), default=-1, help="nodes (default -1: all)")
    g.add_argument("--num_gpus", "--num_accelerators", type=whole(-1, MAX_COUNT), default=-1,
                   help="devices per node; on CPU the number of ranks (default -1: all)")
    g.add_argument("--master_port", type=whole(1, 65535), default=None,
                   help="the answer's port (cmd_optimal.txt; default 29500); each experiment gets a free port")


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str] | None]:
    """zerotune's options and, for ``tune`` and ``run`` with ``-- COMMAND...``, the user's command (None: the
    launcher-style form, ``SCRIPT ARGS...``). A ``--`` after the script is the script's own."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        at = argv.index("--")
        ours = parser.parse_args(argv[:at])
        if ours.command in ("tune", "run") and ours.user_script is None:
            return ours, argv[at + 1:]
    args = parser.parse_args(argv)
    if args.command in ("tune", "run") and args.user_script is None:
        parser.error(f"{args.command}: expected '-- COMMAND...' (the command you train with) or SCRIPT [ARGS...]")
    return args, None


def main(argv: list[str] | None = None) -> int:
    """Run the command line; its exit status: 0 success, 1 no experiment succeeded, 2 bad input (the message names
    the file, key or value), 3 `TRAINING_FAILED`, 128 + the signal on Ctrl-C, SIGTERM or SIGHUP (rerun to resume)."""
    args, command = parse(argv)
    console = Console(stderr=True, soft_wrap=True)
    try:
        if args.command == "estimate":
            return estimate.run(args)
        if args.command == "report":
            return publish.run(args)
        set_verbosity(quiet=args.quiet, verbose=args.verbose)
        user = read_command(command) if command is not None else UserCommand(Launcher(), args.user_script,
                                                                               tuple(args.user_args))
        _launcher_resources(args, user.launcher)
        budget = parse_bytes(args.device_memory) if args.device_memory is not None else None
        host_memory = parse_bytes(args.host_memory, "--host-memory") if args.host_memory is not None else None
        nodes, cpu = _resources(args)
        options = tune_options(args, cpu=cpu, device_memory_bytes=budget, host_memory_bytes=host_memory)
        if args.ray_address is not None and args.backend != "ray":
            raise ConfigError(f"--address {args.ray_address} is a Ray cluster address: it goes with --backend ray")
        if args.json and not args.dry_run:
            raise ConfigError("--json goes with --dry-run")
        # with --json stdout holds the JSON alone: what DeepSpeed prints on import (its accelerator) goes to stderr
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            tuner = Autotuner(user.script, user.script_args, nodes, options, console=console, launcher=user.launcher)
            plan = tuner.plan() if args.dry_run else None
        if plan is not None:
            if args.json:
                print(plan.json_text())
            else:
                out = Console(width=None if sys.stdout.isatty() else 200)
                out.print(plan.header(), soft_wrap=True)
                out.print(plan.table())
            return 0
        try:
            tuner.tune()
        finally:
            if tuner.scheduler.history:
                tuner.print_tuning_results()
        if args.command == "run":
            return training_status(tuner.run_after_tuning(), tuner.job.results_dir)
        return 0
    except ConfigError as e:
        print(f"zerotune: error: {e}", file=sys.stderr)
        return 2
    except TuningFailed as e:
        print(f"zerotune: tuning failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM/SIGHUP while tuning (Interrupted): 128 + the signal
        signum = e.signum if isinstance(e, Interrupted) else 2
        console.print(f"[yellow]zerotune: interrupted ({signal.Signals(signum).name}); finished results are kept, "
                      "rerun to resume[/]")
        return 128 + signum


def tune_options(args: argparse.Namespace, **resolved: Any) -> TuneOptions:
    """The `TuneOptions` of ``tune``'s and ``run``'s parsed options: each field from the option whose ``dest`` is its
    name, ``variables`` from ``--var``, ``longest`` from its fields' options, and ``resolved`` (fields read first: the
    memory sizes, ``cpu``) over them; tests/unit/test_layout.py holds that every field is one of these."""
    given = vars(args)
    named = {f.name: given[f.name] for f in fields(TuneOptions) if f.name in given and f.name not in resolved}
    longest = LongestOptions(**{f.name: given[f.name] for f in fields(LongestOptions)})
    return TuneOptions(**named, variables=dict(parse_cli_variable(v) for v in args.var), longest=longest, **resolved)


def _launcher_resources(args: argparse.Namespace, launcher: Launcher) -> None:
    """Set the launcher options zerotune was not given from the user's launcher: the ``deepspeed`` form's own, or
    torchrun's and Accelerate's ranks per node and nodes.

    Raises:
        ConfigError: zerotune's option and the launcher's disagree (naming both).
    """
    for name, value in launcher.slot_options().items():
        ours = getattr(args, name)
        if ours in (None, -1):
            setattr(args, name, value)
        elif ours != value:
            raise ConfigError(f"--{name} {ours}, but the command after '--' ({' '.join(launcher.words)}) asks for "
                              f"{value}: give it once")


def _resources(args: argparse.Namespace) -> tuple[list, bool | None]:
    """The nodes with their device slots the launcher options select, and whether the ranks run on CPU (None:
    the job decides, on CUDA with a hostfile)."""
    cpu = args.cpu
    if args.backend == "slurm":
        cpu = bool(cpu) or not cuda_available()
        _check_allocation_options(args)
        return backend_nodes(args.backend, cpu, args.num_gpus, args.num_nodes), cpu
    local_slots = None
    include, exclude = args.include or "", args.exclude or ""
    if args.hostfile is None:
        if cpu or not cuda_available():
            cpu = True
            if args.num_gpus < 1 and not include:
                raise ConfigError("--num_gpus N is required on a machine without CUDA: the number of CPU ranks")
            # --include localhost:0,1 on CPU: enough slots to cover the ids
            local_slots = args.num_gpus if args.num_gpus > 0 else slots_named(include)
            if local_slots > MAX_COUNT:
                raise ConfigError(f"--include {include!r}: a device id above {MAX_COUNT - 1}, more than a node has")
    else:  # DeepSpeed's hostfile is read in zerotune.run.resources: bounded here as every file the user names
        user_files.check_file(args.hostfile, f"hostfile {args.hostfile}", "expected lines like 'worker-0 slots=8'")
    nodes = select_resources(args.hostfile, include, exclude, args.num_nodes,
                             args.num_gpus if args.hostfile or not cpu else -1, local_slots)
    return nodes, cpu


def _check_allocation_options(args: argparse.Namespace) -> None:
    """``--backend slurm`` takes no hostfile or node filter: the allocation's nodes are its nodes
    (`zerotune.run.backends.backend_nodes`), which Slurm's own options choose."""
    for flag, value in (("--hostfile", args.hostfile), ("--include", args.include), ("--exclude", args.exclude)):
        if value:
            raise ConfigError(f"{flag} goes with the local backend: with --backend slurm the allocation names the "
                              "nodes (salloc/sbatch --nodes, --nodelist, --exclude)")


def training_status(code: int, results_dir) -> int:
    """``zerotune run``'s exit status for the training launcher's ``code`` (negative: killed by that signal): 0 for 0,
    else `TRAINING_FAILED`, with a line on stderr giving that status and where the results are kept."""
    if code == 0:
        return 0
    try:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    except ValueError:
        how = f"exited with status {code}"
    print(f"zerotune: training failed: the launcher {how}; the tuning's results are kept in {results_dir} "
          f"(ds_config_optimal.json, cmd_optimal.txt)", file=sys.stderr)
    return TRAINING_FAILED


if __name__ == "__main__":
    sys.exit(main())
