"""The checks of `python -m ddpkit.tune` before any trial runs: the fit args against what the worker sets, and the
trial's fit built once per branch of the space (model, data and Trainer, by `main.py fit` itself), which gives the
merged config: the default metric and direction, and where each key of the space sits in it (for best.yaml).
"""

import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from ddpkit.tune.run import TRIAL_CHECK, trial_env
from ddpkit.tune.space import check_sets, value_args
from ddpkit.tune.study import BadInput, Space, config_path, short_key

MODES = {"min": "minimize", "max": "maximize"}


def check_fit_args(fit_args: list[str], space: Space) -> None:
    """The worker owns the devices, the run folder and the space's keys: the fit args may not set them."""
    owned = {short_key(k): f"params.{k} in --space" for k in space.params}
    owned |= {"trainer.devices": "--devices", "trainer.default_root_dir": "--out", "ckpt_path": "a fresh run per trial"}
    for arg in fit_args:
        if arg.startswith("--") and short_key(arg) in owned:
            raise BadInput(f"the fit args set {arg.split('=')[0]}, which the worker sets ({owned[short_key(arg)]})")


def check_fit(main: list[str], fit_args: list[str], devices: int, space: Space, values: dict) -> dict:
    """Build a trial's fit (model, data, Trainer: `main.py fit` with TRIAL_CHECK, which stops before training)
    with `values`; its merged config. An unknown key, a value of the wrong type or options that the Trainer
    refuses (`--trainer.enable_checkpointing false` beside a checkpoint callback) fail here, before any trial."""
    with tempfile.TemporaryDirectory(prefix="ddpkit-tune-check-") as folder:
        written = Path(folder) / "config.yaml"
        cmd = [*main, "fit", *fit_args, "--trainer.devices", str(devices), *value_args(values, space)]
        env = trial_env(**{TRIAL_CHECK: str(written)})
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
        if done.returncode == 0 and written.is_file():
            config = yaml.safe_load(written.read_text())
            return config.get("fit", config)
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("tip:")]
    errors = [line for line in lines if line.startswith("error:")] or lines[-1:] or ["(no message)"]
    # jsonargparse nests the reason under the option it belongs to: its most indented line says what.
    deepest = max(lines[lines.index(errors[0]) :], key=lambda line: len(line) - len(line.lstrip()), default=errors[0])
    reason = errors[0].removeprefix("error:").strip() + ("" if deepest == errors[0] else f" ... {deepest.strip()}")
    if not errors[0].startswith("error:"):  # an exception's last line: `package.module.Error: message`
        head, _, message = reason.partition(": ")
        reason = f"{head.rpartition('.')[2]}: {message}" if message else reason
    shown = " ".join(value_args(values, space))
    raise BadInput(f"main.py fit refuses the fit args with the space's values ({shown}): {reason}")


def check_fits(main: list[str], fit_args: list[str], devices: int, space: Space) -> list[dict]:
    """`check_fit` once per value set of `check_sets` (a conditional key's branch gets its own), at once."""
    sets = check_sets(space)
    with ThreadPoolExecutor(len(sets)) as pool:
        futures = [pool.submit(check_fit, main, fit_args, devices, space, values) for values in sets]
        return [f.result() for f in futures]  # the first set's error first


def key_paths(space: Space, configs: list[dict]) -> dict[str, list[str]]:
    """Where each key sits in the merged config (`model.lr` is model/init_args/lr), read from a checked config
    where it applies; a key that chooses a class is its class_path."""
    paths = {}
    for key in space.params:
        config = next(c for values, c in zip(check_sets(space), configs, strict=True) if key in values)
        path = config_path(config, key)
        node = config
        for part in path:
            node = node[part]
        paths[key] = [*path, "class_path"] if isinstance(node, dict) and "class_path" in node else path
    return paths


def checkpoint_monitor(config: dict) -> tuple[str, str] | None:
    """(monitor, direction) of the first ModelCheckpoint in the fit's config that monitors a metric."""
    for callback in (config.get("trainer") or {}).get("callbacks") or []:
        if isinstance(callback, dict) and str(callback.get("class_path", "")).endswith("ModelCheckpoint"):
            args = callback.get("init_args") or {}
            if args.get("monitor"):
                return str(args["monitor"]), MODES.get(args.get("mode", "min"), "minimize")
    return None
