"""Hyperparameter search in which every trial is a DDP run: `python main.py fit` on D devices per trial.

    python -m ddpkit.tune --space SPACE.yaml --trials N --devices D [--storage URL] [--study NAME] [--out DIR]
        [--parallel K] [--checkpoints best|all|none] [-- MAIN.PY FIT ARGS]

Run it from the project's root (or name the CLI with `--main`, as for `python -m ddpkit.scaling`). This process,
the worker, asks Optuna for a trial's values and runs `python main.py fit <fit args> --trainer.devices D
--trainer.default_root_dir <out>/trial_K --<key> <value> ...` as real processes: the values reach every rank as
command-line arguments, so all ranks train with the same ones by construction. After each validation rank 0
sends the metric to the worker, which reports it to the study and asks the pruner; the answer reaches every rank
through the strategy (a broadcast), so all of them stop after the same step and the fit ends cleanly
(ddpkit/run/trial.py). The batch is global, so values found on 2 devices mean the same on 8.

SPACE.yaml:

    metric: val/loss            # default: the checkpoint monitor of the fit's config
    direction: minimize         # default: that monitor's mode
    params:                     # dotted config keys, as on main.py's command line
      model.init_args.optimizer.init_args.lr: {low: 1.0e-4, high: 1.0e-1, log: true}   # float (int: int bounds)
      model.init_args.hidden_dim: {choices: [64, 128, 256]}
      model.init_args.optimizer: {choices: [torch.optim.AdamW, torch.optim.SGD]}      # a class ...
      model.init_args.optimizer.init_args.momentum:                                   # ... and its own argument
        {low: 0.0, high: 0.99, when: {model.init_args.optimizer: torch.optim.SGD}}
    sampler: {class_path: optuna.samplers.TPESampler, init_args: {seed: 0}}              # optional
    pruner: {class_path: optuna.pruners.MedianPruner, init_args: {n_startup_trials: 2}}  # optional
    clock: samples              # what the pruner compares trials at: samples seen (default) or steps

A trial's value is the metric at its last validation; it must be logged in validation. Intermediate values are
reported at the samples the trial has trained on (optimizer steps x the global batch: trials of different batches
compare at the same data seen), or at the optimizer step with `clock: steps`. A seeded sampler is seeded anew for
each trial from its seed and the trial's number, and a proposal that repeats the values of a trial that ran or
runs is not run (the sampler is asked again): restarts and other workers draw new values (ddpkit/tune/space.py).

--storage, where the study lives (several workers share one study through it):
  (default)                         SQLite in <out>/study.db: one machine, nothing to start
  postgresql://USER:PASS@HOST/DB    PostgreSQL: workers on several machines (psycopg, the `tune` extra)
  journal:PATH                      Optuna's journal file: a filesystem that every worker mounts (SLURM arrays),
                                    no database server
Any other SQLAlchemy URL (mysql+pymysql://...) goes to Optuna's RDBStorage as it is.

--trials N is the study's total of finished (complete or pruned) trials: each worker stops when the study has N,
waiting for the other workers' last trials. Starting the same command again continues a study; an interrupted
trial's values run again from its last checkpoint. A worker beats its trial's heartbeat (a user attribute) every
--heartbeat seconds; a RUNNING trial whose heartbeat is older than twice that (its worker was killed) is failed by
the next worker that looks, and its values run again as a new trial. Workers' clocks must agree to well within that.

On a node with G GPUs (CUDA_VISIBLE_DEVICES, else nvidia-smi) a worker runs floor(G / D) trials at once, each on
D GPUs of its own (its CUDA_VISIBLE_DEVICES) with a rendezvous port of its own; workers on one node never share a
GPU (ddpkit/tune/devices.py: a lock file per GPU in $DDPKIT_CLAIMS, default /tmp/ddpkit-claims). Without GPUs
--parallel K runs K CPU trials at once (default 1).

<out>/ holds trial_K/ (each trial's logs, and its checkpoints while the study needs them: --checkpoints best keeps
the best trial's only, all keeps every trial's, none keeps none; `--ckpt_path last/best/auto` skip them, as the
scaling sweep's), trial_K.log (its output), trials.md (every trial, also printed at the end), best.yaml (the best
values as a config: `python main.py fit --config config.yaml --config <out>/best.yaml`) and history.png,
importances.png (matplotlib, in the `tune` extra).
"""

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from ddpkit.scaling.sweeper import main_command, mark_sweep
from ddpkit.tune.checks import check_fit_args, check_fits, checkpoint_monitor, key_paths
from ddpkit.tune.devices import concurrent_trials, gpu_uuids, visible_gpus
from ddpkit.tune.report import NO_PLOTS, best_trial, can_plot, plot, progress, train_command, values_text, write_results
from ddpkit.tune.run import KEEP, tidy_checkpoints
from ddpkit.tune.space import load_space
from ddpkit.tune.study import BadInput, open_storage, open_study, shown_url
from ddpkit.tune.worker import Worker, stop, work

_signals = [signal.SIGINT]  # the signal that stopped the worker


def interrupt(signum: int, frame: Any) -> None:
    """SIGTERM (a scheduler's stop) as Ctrl-C: the running trials are killed, failed and queued again."""
    _signals.append(signum)
    raise KeyboardInterrupt


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ours, fit_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        prog="python -m ddpkit.tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--space", type=Path, required=True, help="the search space file (YAML; see above)")
    add("--trials", type=int, required=True, help="finished trials the study needs, all workers together")
    add("--devices", type=int, default=1, help="devices (GPUs or CPU processes) per trial (default 1)")
    add("--storage", help="where the study lives (default: SQLite in <out>/study.db; see above)")
    add("--study", help="the study's name (default: the space file's name without .yaml)")
    add("--out", type=Path, default=Path("tune"), help="output folder (default ./tune)")
    add("--main", default="main.py", help="the project CLI: a file (default ./main.py) or a module name")
    add(
        "--heartbeat",
        type=float,
        default=60.0,
        help="seconds between a running trial's heartbeats; a trial silent for twice this is failed "
        "and its values run again (default 60)",
    )
    add("--timeout", type=float, help="seconds after which a trial is killed and failed (default: none)")
    add(
        "--parallel",
        type=int,
        help="trials at once in this worker (default: as many as its GPUs hold, floor(GPUs / --devices); 1 on CPU)",
    )
    add(
        "--checkpoints",
        choices=KEEP,
        default="best",
        help="whose checkpoints stay once trials end: the best trial's (default), all, none; a trial keeps its "
        "own until it ends, and an interrupted one until its values have run again",
    )
    add("--allow-repeats", action="store_true", help="run proposals that repeat a trial's values (default: skip)")
    args = parser.parse_args(ours)
    if args.trials < 1 or args.devices < 1 or args.heartbeat <= 0 or (args.parallel is not None and args.parallel < 1):
        parser.error("--trials, --devices and --parallel must be >= 1, --heartbeat > 0")
    return args, fit_args


def main(argv: list[str] | None = None) -> None:
    args, fit_args = parse(sys.argv[1:] if argv is None else argv)
    try:
        import optuna
    except ImportError:
        sys.stderr.write('error: python -m ddpkit.tune needs Optuna: pip install -e ".[tune]" (ddpkit[tune])\n')
        sys.exit(2)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the worker prints its own line per trial
    try:
        if args.out.resolve() == Path.cwd().resolve():
            raise BadInput("--out must be a folder of its own: --ckpt_path last/best/auto skip it, and so its runs")
        space = load_space(args.space)
        check_fit_args(fit_args, space)
        gpus = visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), gpu_uuids())
        slots = concurrent_trials(gpus, args.devices, args.parallel)
        main_cmd = main_command(args.main)
        args.out.mkdir(parents=True, exist_ok=True)
        storage = open_storage(args.storage, args.out)
        configs = check_fits(main_cmd, fit_args, args.devices, space)
        paths = key_paths(space, configs)
        monitor = checkpoint_monitor(configs[0])
        metric = space.metric or (monitor[0] if monitor else None)
        if metric is None:
            raise BadInput(f"--space {args.space}: no metric: name one (metric: val/loss); the config monitors none")
        direction = space.direction or (monitor[1] if monitor and monitor[0] == metric else "minimize")
        study = open_study(storage, args.study or args.space.stem, space, metric, direction)
    except BadInput as error:
        sys.stderr.write(f"error: {error}\n")
        sys.exit(2)
    mark_sweep(args.out, "python -m ddpkit.tune")
    where = shown_url(args.storage) if args.storage else f"sqlite:///{args.out / 'study.db'}"
    on = f"GPUs {','.join(gpus)}" if gpus else "CPU"
    print(
        f"study {study.study_name!r} in {where}: {direction} {metric}, reported at {space.clock}; "
        f"{progress(study, args.trials, metric)}; {slots} trial(s) at once of {args.devices} device(s) on {on}",
        flush=True,
    )
    if not can_plot():
        print(NO_PLOTS, flush=True)
    worker = Worker(
        main_cmd,
        args.devices,
        args.out,
        fit_args,
        space,
        metric,
        args.trials,
        args.heartbeat,
        args.timeout,
        paths,
        gpus,
        slots,
        args.checkpoints,
        args.allow_repeats,
    )
    signal.signal(signal.SIGTERM, interrupt)
    try:
        work(study, worker)
    except KeyboardInterrupt:
        stop(worker)
        write_results(study, space, metric, args.trials, paths, fit_args, args.out)
        sys.exit(128 + _signals[-1])
    except (BadInput, SystemExit) as error:
        stop(worker)
        write_results(study, space, metric, args.trials, paths, fit_args, args.out)
        if isinstance(error, SystemExit):
            raise
        sys.stderr.write(f"error: {error}\n")
        sys.exit(2)
    tidy_checkpoints(study, args.out, args.checkpoints)
    print("\n" + write_results(study, space, metric, args.trials, paths, fit_args, args.out), flush=True)
    plots = plot(study, metric, args.out)
    best = best_trial(study)
    print(f"study {study.study_name!r}: {progress(study, args.trials, metric)}")
    if best is not None:
        print(f"best: trial {best.number}, {values_text(best.params)}; train it: {train_command(args.out, fit_args)}")
    print(f"written: {args.out / 'trials.md'}" + (", best.yaml" if best else "") + "".join(f", {p}" for p in plots))


if __name__ == "__main__":
    main()
