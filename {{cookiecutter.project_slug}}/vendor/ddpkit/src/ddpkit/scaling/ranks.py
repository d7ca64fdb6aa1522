"""The scaling sweep's preflight (`python -m ddpkit.scaling --preflight --devices N`): what each process of an
N-device fit will see (devices, backend, cores, threads, loader workers), and whether N processes can join one
process group and all-reduce, before any training."""

import os
import socket
import subprocess


def visible_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one, as under SLURM)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _rank_report(rank: int, world: int, port: int, queue, cuda: bool) -> None:
    """One process of the preflight: join the process group as training would, report what it sees."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(rank)  # one node: local rank = rank, as Lightning maps it
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ones = torch.ones(1, device=device)
    dist.all_reduce(ones)  # proves the backend can talk between all ranks
    cores = visible_cores()
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    current = torch.cuda.current_device() if cuda else None
    queue.put((rank, str(device), current, name, cores, int(ones.item())))
    dist.destroy_process_group()


def _fit_config(main: list[str], fit_args: list[str]) -> dict | None:
    """The merged config of a fit with these args (`main.py fit --print_config`), None if it fails."""
    import yaml

    out = subprocess.run([*main, "fit", *fit_args, "--print_config"], capture_output=True, text=True, timeout=300)
    return yaml.safe_load(out.stdout) if out.returncode == 0 else None


def _num_workers(config: dict | None) -> str:
    """The fit's effective --data.num_workers."""
    if config is None:
        return "? (fit --print_config failed)"
    data = config.get("data") or {}
    return str((data.get("init_args") or data).get("num_workers", "? (not an argument of this data module)"))


def _uses_cuda(config: dict | None, cuda_available: bool) -> bool:
    """Whether the fit runs on GPUs: `--trainer.accelerator gpu/cuda`, or `auto` with a GPU visible."""
    accelerator = ((config or {}).get("trainer") or {}).get("accelerator", "auto")
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and cuda_available)


def preflight(main: list[str], devices: int, fit_args: list[str]) -> None:
    """Print what the seed guides say to check by hand before a multi-device run."""
    import torch
    import torch.multiprocessing as mp

    config = _fit_config(main, fit_args)
    cuda = _uses_cuda(config, torch.cuda.is_available())  # the fit's accelerator: cpu means gloo, GPUs or not
    cores = visible_cores()
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    print(f"visible devices (torch.cuda.device_count()): {torch.cuda.device_count()}")
    print(f"CUDA_VISIBLE_DEVICES: {os.environ.get('CUDA_VISIBLE_DEVICES', '(not set)')}")
    print(f"backend: {'nccl' if cuda else 'gloo'}")
    if cuda and devices > torch.cuda.device_count():
        raise SystemExit(f"{devices} devices requested but only {torch.cuda.device_count()} visible")
    # Lightning gives each rank cores // ranks threads unless OMP_NUM_THREADS is set.
    print(f"CPU cores visible: {cores}; per rank with {devices} ranks: {max(1, cores // devices)}")
    print(f"OMP_NUM_THREADS: {os.environ.get('OMP_NUM_THREADS', '(not set: Lightning sets cores per rank)')}")
    print(f"dataloader workers per rank (--data.num_workers): {_num_workers(config)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_rank_report, args=(devices, port, queue, cuda), nprocs=devices, start_method="spawn")
    reports = sorted(queue.get() for _ in range(devices))
    print("rank | device | current_device | name | cores visible | all_reduce(1)")
    for rank, device, current, name, rank_cores, total in reports:
        print(f"{rank:>4} | {device} | {current} | {name} | {rank_cores} | {total}")
    if any(r[5] != devices for r in reports):
        raise SystemExit("all_reduce gave a wrong sum: the process group is broken")
    print(f"ok: {devices} processes joined one {'nccl' if cuda else 'gloo'} group and all-reduced correctly")
