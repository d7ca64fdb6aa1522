"""Bad command-line input fails at once: one `error:` line, status 2, no rank started, nothing written.
Risky configuration is caught early: a monitored metric the module never logs, a plain data module."""

import json
import os
import pickle
import re
import sys
from pathlib import Path

import pytest
import torch
from procs import TESTS, concurrently, fake_gpus_env, run, toy, toy_ok
from streams import PlainStream
from test_lightning_internals import KeepsOptimizer

from ddpkit.run import checks
from ddpkit.run.cli import (
    BadInput,
    check_checkpoint,
    check_state_dict_fits,
    iterable_data_warning,
    newest_last_checkpoint,
    plain_datamodule_warning,
    resolve_ckpt_path,
)
from ddpkit.run.init_args import carried_init_args, given_keys
from ddpkit.scaling.sweeper import SWEEP_MARKER
from ddpkit.testing.toy import PlainToyData, ToyClassifier
from ddpkit.testing.toy import main as toy_main

# Runs at start-up on rank 1 only if a launcher starts it (LOCAL_RANK=1): leaves a file that proves a rank
# was spawned. Then procs.FAKE_CUDA fakes the GPUs a case asks for (FAKE_CUDA_DEVICES).
SPAWN_MARKER = """
import os
if os.environ.get("LOCAL_RANK", "0") != "0":
    open(os.environ["SPAWN_MARKER"], "w").close()
"""


class Payload:
    """Pickled into a 'checkpoint': unpickling it would run code."""

    def __reduce__(self):
        return (print, ("code from the checkpoint ran",))


def checkpoints(directory):
    """A foreign model's checkpoint, one whose weights do not fit, and one that runs code when unpickled."""
    directory.mkdir()
    weights = ToyClassifier().state_dict()
    torch.save({"state_dict": weights, "hyper_parameters": {"_class_path": "other.Model"}}, directory / "other.ckpt")
    torch.save({"state_dict": ToyClassifier(hidden_dim=8).state_dict()}, directory / "shapes.ckpt")
    with open(directory / "evil.ckpt", "wb") as f:
        pickle.dump({"state_dict": weights, "payload": Payload()}, f)
    return directory


CASES = {
    "unknown flag": (["--trainer.devicez", "2"], "unrecognized arguments: --trainer.devicez"),
    "no GPU": (["--trainer.accelerator", "gpu"], "--trainer.devices asks for 2 GPUs but no CUDA GPU is visible"),
    "no GPU, devices auto": (
        ["--trainer.accelerator", "gpu", "--trainer.devices", "auto"],
        "--trainer.accelerator gpu but no CUDA GPU is visible: use --trainer.accelerator cpu",
    ),
    "1 GPU, 2 asked": (
        ["--trainer.accelerator", "auto"],
        "--trainer.devices asks for 2 GPUs but only 1 GPU visible: use --trainer.devices 1 or fewer",
    ),
    "nothing to resume": (["--ckpt_path", "last"], "--ckpt_path last: no complete last.ckpt under"),
    "indivisible batch": (["--data.global_batch_size", "63"], "global_batch_size=63 does not divide evenly over 2"),
    "zero stop check": (["--stop_check_every_n_steps", "0"], "stop_check_every_n_steps"),
    "missing checkpoint": (["--ckpt_path", "nope.ckpt"], "--ckpt_path nope.ckpt does not exist"),
    "other model": (["--ckpt_path", "CKPTS/other.ckpt"], "was saved by model other.Model, but the model is"),
    "other shapes": (["--ckpt_path", "CKPTS/shapes.ckpt"], "holds weights of a different model (0 missing, 0 unexp"),
    "code in checkpoint": (["--ckpt_path", "CKPTS/evil.ckpt"], "is not a checkpoint that loads as plain weights"),
}

# GPUs the case's process sees (tests/fake_cuda.py), whatever this machine has: the GPU checks give the same
# answer on a machine with 0, 1 or 8 GPUs, and a GPU machine never starts a real run here.
VISIBLE_GPUS = {"no GPU": 0, "no GPU, devices auto": 0, "1 GPU, 2 asked": 1}


# These run as real launches of `python -m ddpkit.toy` (the entry point; the GPUs faked at start-up): one that
# fails on the GPU count, one that fails last, after model, data and trainer exist. The others run one after
# another in one interpreter (one_interpreter.py), which saves torch's and Lightning's import for each; a rank
# that any of them launched would still leave its marker, and writes would land in its own folder.
LAUNCHED = {"1 GPU, 2 asked", "other shapes"}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Each bad command on 2 CPU processes, each in an empty folder: {name: (exit status, output, whether a rank
    was spawned, what its folder holds)}."""
    base = tmp_path_factory.mktemp("bad")
    ckpts = checkpoints(base / "ckpts")
    site = fake_gpus_env(base / "site", 0, SPAWN_MARKER)  # written once, before the runs start
    del site["FAKE_CUDA_DEVICES"]  # set below for the cases that fake GPUs; the others see this machine's
    folder = {name: base / name.replace(" ", "_") for name in CASES}
    cases = {}
    for name in CASES:
        folder[name].mkdir()
        args = [a.replace("CKPTS", str(ckpts)) for a in CASES[name][0]]
        cases[name] = {
            "args": ["fit", "--trainer.accelerator", "cpu", "--trainer.devices", "2", *args],
            "cwd": str(folder[name]),
            "gpus": VISIBLE_GPUS.get(name),
            "env": {"SPAWN_MARKER": f"{folder[name]}.spawned"},
            "out": f"{folder[name]}.out",
        }

    def launch(name):
        c = cases[name]
        env = {**site, **c["env"]} | ({} if c["gpus"] is None else {"FAKE_CUDA_DEVICES": str(c["gpus"])})
        # A hang guard, not a speed bound: beside CI's jobs at load 15 on 2 cores this fixture errored with guards of
        # 120 s and 240 s, where `main.py fit --help` took 203 s (a run of 2026-12-06, stopped before its report).
        result = toy(*c["args"], cwd=folder[name], env=env, timeout=600)
        return {name: (result.returncode, result.stdout)}

    def in_one_interpreter(names):
        (base / "cases.json").write_text(json.dumps([cases[name] for name in names]))
        cmd = [sys.executable, str(TESTS / "one_interpreter.py"), str(base / "cases.json")]
        interpreter = run(cmd, base, timeout=600, env=site)
        ran = {}
        for name in names:  # a case the interpreter did not finish: status None, its output and the interpreter's
            out = Path(cases[name]["out"])
            out = out.read_text() if out.exists() else ""
            ended = re.search(r"\nexit status (-?\d+)\n$", out)
            ran[name] = (int(ended[1]), out[: ended.start()]) if ended else (None, out + interpreter.stdout)
        return ran

    together = [name for name in CASES if name not in LAUNCHED]
    jobs = {name: lambda n=name: launch(n) for name in LAUNCHED} | {"": lambda: in_one_interpreter(together)}
    ran = {}
    for done in concurrently(lambda job: jobs[job](), jobs).values():
        ran |= done
    return {
        name: (
            code,
            out,
            Path(cases[name]["env"]["SPAWN_MARKER"]).exists(),
            sorted(p.name for p in folder[name].iterdir()),
        )
        for name, (code, out) in ran.items()
    }


@pytest.mark.parametrize("name", CASES)
def test_bad_input_fails_fast_with_one_line(outcomes, name):
    """Status 2 and an `error:` line naming the problem; no rank 1 process started; no file written."""
    code, out, spawned, written = outcomes[name]
    errors = [line for line in out.splitlines() if "error:" in line]
    assert code == 2, out[-3000:]
    assert len(errors) == 1 and CASES[name][1] in errors[0], out[-3000:]
    assert not spawned and written == []
    assert "code from the checkpoint ran" not in out


class HandsItOn(KeepsOptimizer):
    """A subclass that takes its parent's arguments, the optimizer among them, as `**kwargs`."""

    def __init__(self, extra: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)


@pytest.mark.parametrize("model", ["KeepsOptimizer", "HandsItOn", "ToyClassifier"])
def test_lightnings_optimizer_flag_is_refused_where_the_model_takes_an_optimizer(capsys, model):
    """`--optimizer SGD` would replace the model's configure_optimizers and drop its own optimizer: refused with one
    line for a model that takes one, also through `**kwargs`; a model that takes none gets LightningCLI's SGD.
    Mutation: the model's signature alone asked (HandsItOn's shows `kwargs`): it trains with SGD, silently."""
    homes = {"ToyClassifier": "ddpkit.testing.toy", "KeepsOptimizer": "test_lightning_internals"}
    path = f"{homes.get(model, 'test_bad_input')}.{model}"
    args = ["--model", path, "--optimizer", "torch.optim.SGD", "--trainer.logger", "false"]
    if model == "ToyClassifier":
        cli = toy_main(args, run=False)
        assert isinstance(cli.model.configure_optimizers(), torch.optim.SGD)
        return
    with pytest.raises(SystemExit) as stop:
        toy_main(args, run=False)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert stop.value.code == 2 and errors == [
        f"error: --optimizer would replace {model}.configure_optimizers: this model takes its optimizer and schedule "
        f"as arguments, so use --model.optimizer CLASS (--model.optimizer.lr ...) and --model.scheduler CLASS; see "
        f"python main.py fit --model.help {model}."
    ]


def test_checkpoint_arguments_that_replace_given_ones_are_warned(tmp_path, capsys):
    """--ckpt_path saved with hidden_dim=32 while 64 is configured: one warning line names both values."""
    hparams = {"_class_path": "m.Model", "hidden_dim": 32, "lr": 0.1}
    torch.save({"state_dict": {}, "hyper_parameters": hparams}, tmp_path / "a.ckpt")
    check_checkpoint(str(tmp_path / "a.ckpt"), {"class_path": "m.Model", "init_args": {"hidden_dim": 64, "lr": 0.1}})
    assert capsys.readouterr().err == (
        "warning: --ckpt_path restores the model arguments saved in the checkpoint: hidden_dim=32 (configured 64)\n"
    )


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_checks_accept_good_checkpoints_in_either_format(tmp_path, zipfile):
    """The checks map zip checkpoints lazily and fall back to a plain load for the legacy format;
    a fitting checkpoint passes both, and a foreign one still fails."""
    path = str(tmp_path / "good.ckpt")
    weights = ToyClassifier().state_dict()
    torch.save({"state_dict": weights}, path, _use_new_zipfile_serialization=zipfile)
    check_checkpoint(path, {"class_path": "x.Y"})
    check_state_dict_fits(ToyClassifier(), path)
    with pytest.raises(BadInput, match="holds weights of a different model"):
        check_state_dict_fits(ToyClassifier(hidden_dim=8), path)


def test_a_checkpoint_fits_a_module_that_builds_its_layers_in_configure_model(tmp_path):
    """Weights under a submodule the module has not built yet (configure_model runs after the check) are not a
    different model's; a weight the module has and the checkpoint lacks still is, and so is a layer more inside a
    container it has built."""

    class Lazy(ToyClassifier):
        def __init__(self, extra: bool = False, built: bool = False) -> None:
            super().__init__()
            self.net = self.net if built else None  # else built in configure_model
            self.extra = torch.nn.Linear(2, 2) if extra else None

        def configure_model(self) -> None:
            if self.net is None:
                self.net = ToyClassifier().net

    path = str(tmp_path / "built.ckpt")
    torch.save({"state_dict": ToyClassifier().state_dict()}, path)
    check_state_dict_fits(Lazy(), path)
    with pytest.raises(BadInput, match=r"\(2 missing, 0 unexpected, 0 of another shape, e.g. extra.bias"):
        check_state_dict_fits(Lazy(extra=True), path)
    torch.save({"state_dict": {**ToyClassifier().state_dict(), "net.9.weight": torch.ones(1)}}, path)
    with pytest.raises(BadInput, match=r"\(0 missing, 1 unexpected, 0 of another shape, e.g. net.9.weight\)"):
        check_state_dict_fits(Lazy(built=True), path)


@pytest.mark.parametrize(
    ("accelerator", "shards_on_cpu", "refused"),
    [("cpu", False, True), ("gpu", False, False), ("cpu", True, False)],
    ids=["cpu-before-2.6", "gpu", "cpu-from-2.6"],
)
def test_sharding_on_cpu_is_refused_where_fsdp2_needs_cuda(monkeypatch, accelerator, shards_on_cpu, refused):
    """ModelParallelStrategy on CPU processes is refused in one line naming torch's version where FSDP2 needs CUDA
    (before torch 2.6), and passes the check on GPUs or where torch shards on CPU."""
    monkeypatch.setattr(checks, "shards_on_cpu", lambda: shards_on_cpu)
    sharded = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy"}
    expected = rf"from torch 2.6; this is torch {re.escape(torch.__version__)}: train it on GPUs"
    if refused:
        with pytest.raises(BadInput, match=expected):
            checks.check_sharding_device({"accelerator": accelerator, "strategy": sharded})
    else:
        checks.check_sharding_device({"accelerator": accelerator, "strategy": sharded})
    checks.check_sharding_device({"accelerator": accelerator, "strategy": "ddp"})  # DDP runs anywhere


def test_unlogged_monitor_fails_at_the_sanity_check_naming_the_logged_keys(tmp_path):
    """monitor: val_acc (the toy model logs val/acc): the run stops at the sanity check, before any training
    step or checkpoint, and names the keys the module does log."""
    (tmp_path / "monitor.yaml").write_text(
        "trainer:\n  callbacks:\n"
        "    - class_path: ddpkit.run.checkpoints.CurrentModelCheckpoint\n"
        "      init_args:\n        monitor: val_acc\n"
    )  # merged into the list entry of ddpkit/testing/toy.yaml with the same class
    cpu = ("--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.default_root_dir", str(tmp_path))
    result = toy("fit", "--config", str(tmp_path / "monitor.yaml"), *cpu, cwd=tmp_path)
    assert result.returncode != 0, result.stdout[-3000:]
    expected = "ModelCheckpoint monitors 'val_acc', which the module does not log in validation; it logs ['val/acc', "
    assert expected in result.stdout, result.stdout[-3000:]
    assert not list(tmp_path.rglob("*.ckpt")) and "Epoch 0:" not in result.stdout


def test_plain_datamodule_runs_with_one_warning_line(tmp_path):
    """A plain LightningDataModule trains on 2 processes; the CLI says once, before any rank starts, what it loses;
    its training data being an IterableDataset, once more before the first step, that every rank reads all of it."""
    cpu = ("--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.max_steps", "2")
    root = ("--trainer.default_root_dir", str(tmp_path))
    out = toy_ok("fit", "--data", "streams.PlainStream", *cpu, *root, cwd=tmp_path)
    lines = [line for line in out.splitlines() if "is a plain LightningDataModule" in line]
    assert lines == [plain_datamodule_warning(PlainStream())]
    assert "subclass ddpkit.GlobalBatchDataModule" in lines[0]
    iterable = [line for line in out.splitlines() if "is an IterableDataset" in line]
    assert iterable == [iterable_data_warning(PlainStream().train_dataloader(), 2)]
    assert "(_BlobStream)" in iterable[0] and "each sample 2 times per epoch" in iterable[0]


def test_iterable_data_warning_only_for_iterable_data_on_several_processes():
    """A map-style loader, or an iterable one on 1 process, gets no iterable-data warning."""
    assert iterable_data_warning(PlainToyData().train_dataloader(), 2) is None
    assert iterable_data_warning(PlainStream().train_dataloader(), 1) is None
    assert iterable_data_warning({"a": PlainStream().train_dataloader()}, 4) is not None


def save(path, mtime, **content):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(content, path)
    os.utime(path, (mtime, mtime))
    return path


def test_last_is_the_newest_complete_last_checkpoint(tmp_path):
    """`--ckpt_path last` finds the most recent last.ckpt in any run under the root, skipping a torn file, a
    sharded directory without its index, hidden directories (virtual environments, .git) and a scaling sweep's
    folder below the root."""
    save(tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt", 100, step=1)
    newest = save(tmp_path / "runs/b/lightning_logs/version_3/checkpoints/last.ckpt", 200, step=2)
    torn = save(tmp_path / "lightning_logs/version_1/checkpoints/last.ckpt", 300, step=3)
    torn.write_bytes(torn.read_bytes()[:-40])  # the end of the archive is missing, as after a non-atomic write
    os.utime(torn, (300, 300))
    save(tmp_path / ".venv/checkpoints/last.ckpt", 400, step=4)
    sharded = tmp_path / "lightning_logs/version_2/checkpoints/last.ckpt"
    sharded.mkdir(parents=True)
    assert newest_last_checkpoint(tmp_path) == newest
    (sharded / ".metadata").write_bytes(b"index")
    assert newest_last_checkpoint(tmp_path) == sharded
    assert newest_last_checkpoint(tmp_path / "runs") == newest  # under the path given
    assert newest_last_checkpoint(tmp_path / "empty") is None
    # A scaling sweep's runs, written after the training: skipped from a folder above, found from its own.
    swept = save(tmp_path / "scaling/devices_2/lightning_logs/version_0/checkpoints/last.ckpt", 2e9, step=5)
    assert newest_last_checkpoint(tmp_path) == swept  # not yet marked
    (tmp_path / "scaling" / SWEEP_MARKER).write_text("")
    assert newest_last_checkpoint(tmp_path) == sharded
    assert newest_last_checkpoint(tmp_path / "scaling") == swept


def test_ckpt_path_last_and_best_become_files(tmp_path):
    """`last` becomes the newest last.ckpt (and fit continues its run directory); `best` for test becomes the best
    checkpoint that last.ckpt's checkpoint callback recorded; best for fit, or a vanished best, is refused."""
    best = save(tmp_path / "lightning_logs/version_0/checkpoints/best-epoch01-step8.ckpt", 100)
    state = {"CurrentModelCheckpoint{'monitor': 'val/acc'}": {"best_model_path": str(best)}}
    last = save(tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt", 100, callbacks=state)
    config = {"ckpt_path": "last", "trainer": {"default_root_dir": str(tmp_path)}}
    assert resolve_ckpt_path(config, "fit") == tmp_path / "lightning_logs/version_0"
    assert config["ckpt_path"] == str(last)
    config = {"ckpt_path": "last", "trainer": {"default_root_dir": str(tmp_path)}}
    assert resolve_ckpt_path(config, "validate") is None and config["ckpt_path"] == str(last)
    config = {"ckpt_path": "best", "trainer": {"default_root_dir": str(tmp_path)}}
    assert resolve_ckpt_path(config, "test") is None and config["ckpt_path"] == str(best)
    with pytest.raises(BadInput, match="--ckpt_path best is for validate, test and predict"):
        resolve_ckpt_path({"ckpt_path": "best", "trainer": {"default_root_dir": str(tmp_path)}}, "fit")
    best.unlink()
    with pytest.raises(BadInput, match="records no best checkpoint that still exists"):
        resolve_ckpt_path({"ckpt_path": "best", "trainer": {"default_root_dir": str(tmp_path)}}, "predict")
    config = {"ckpt_path": str(last), "trainer": {}}
    assert resolve_ckpt_path(config, "fit") is None and config["ckpt_path"] == str(last)  # a file stays a file


def test_ckpt_path_auto_resumes_the_furthest_checkpoint_or_starts(tmp_path, capsys):
    """`fit --ckpt_path auto` starts a new run (one line says so) when the root holds no complete checkpoint, then
    resumes the newest last.ckpt (continuing its run directory), or a SLURM requeue's hpc_ckpt_N.ckpt when that is
    as far in training (the stopped job's last.ckpt of the same step, written after it, counts its epoch as done);
    it is refused for evaluation, which has nothing to restart."""
    config = {"ckpt_path": "auto", "trainer": {"default_root_dir": str(tmp_path)}}
    assert resolve_ckpt_path(config, "fit") is None and config["ckpt_path"] is None
    started = f"fit: --ckpt_path auto: no complete checkpoint under {tmp_path}; starting a new run\n"
    assert capsys.readouterr().err == started
    save(tmp_path / "hpc_ckpt_1.ckpt", 50, global_step=20)  # a requeue's, resumed since, and a node failure later
    last = save(tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt", 100, global_step=32)
    config = {"ckpt_path": "auto", "trainer": {"default_root_dir": str(tmp_path)}}
    assert resolve_ckpt_path(config, "fit") == tmp_path / "lightning_logs/version_0"
    assert config["ckpt_path"] == str(last) and capsys.readouterr().err == f"fit: --ckpt_path auto is {last}\n"
    hpc = save(tmp_path / "hpc_ckpt_2.ckpt", 90, global_step=32)  # the next requeue's: older file, same step
    save(tmp_path / "hpc_ckpt_10.ckpt", 150).write_bytes(b"torn")  # the highest number, but not a whole file
    config = {"ckpt_path": "auto", "trainer": {"default_root_dir": str(tmp_path)}}
    assert resolve_ckpt_path(config, "fit") is None and config["ckpt_path"] == str(hpc)  # SLURM's job id keeps the logs
    with pytest.raises(BadInput, match="--ckpt_path auto is for fit"):
        resolve_ckpt_path({"ckpt_path": "auto", "trainer": {"default_root_dir": str(tmp_path)}}, "validate")


# Switches the toy's data class (ToyData in ddpkit/testing/toy.yaml: global_batch_size 64, train_size 1079) to
# families.py's SmallToyData (defaults 32 and 128) three ways, building model, data and trainer only; prints what the
# data got.
CLASS_SWITCH = """
import sys
from ddpkit.testing.toy import main
cpu = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.logger", "false"]
for args in (["--config", sys.argv[1]], ["--data", "families.SmallToyData"], ["--config", sys.argv[1], *sys.argv[2:]]):
    data = main([*args, *cpu], run=False).datamodule
    print("DATA", type(data).__name__, data.global_batch_size, data.train_size, file=sys.stderr, flush=True)
"""


def test_a_class_switch_that_keeps_the_default_configs_values_is_warned(tmp_path):
    """`--config my.yaml` (or `--data Other`) that changes the data class keeps config.yaml's values for arguments of
    the same name (jsonargparse's merge): one warning line names each with the new class's own default, and leaves
    out those given on the command line."""
    (tmp_path / "my.yaml").write_text("data:\n  class_path: families.SmallToyData\n")
    given = ["--data.train_size", "256", "--data.init_args.global_batch_size=16"]
    result = run([sys.executable, "-c", CLASS_SWITCH, str(tmp_path / "my.yaml"), *given], TESTS, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("warning: --data", "DATA"))]
    kept = (
        "global_batch_size=64 (its default: 32), train_size=1079 (its default: 128) "
        "from ddpkit.testing.toy.ToyData in toy.yaml"
    )
    assert lines == [
        f"warning: --data families.SmallToyData keeps {kept}: arguments of the same name carry over when the class "
        "changes. Give them for SmallToyData in your config, or point toy.yaml itself at it.",
        "DATA SmallToyData 64 1079",
    ] * 2 + ["DATA SmallToyData 16 256"]


def test_given_keys_are_the_command_lines_and_the_config_files():
    """A section's keys named on the command line (`--data.x`, `--data.init_args.x=...`) and in `--config` files."""
    assert given_keys(["fit", "--data.a", "1", "--data.init_args.b=2", "--model.c", "3"], "data") == {"a", "b"}
    assert carried_init_args("data", {"class_path": "m.A"}, {"class_path": "m.A"}, set(), "config.yaml") is None
