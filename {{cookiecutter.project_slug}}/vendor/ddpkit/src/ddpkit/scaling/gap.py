"""Why N devices are not N times faster: the gap between a run on N devices and the ideal, split into
measured parts that add up, and what more devices would give.

Pure functions of doctor summaries (doctor.json) of runs with the same config and global batch; used by
`scaling.py` (the sweep's table and `--explain RUN_1 RUN_N`).

The ideal step on N devices is the base run's step x base devices / N (the same global batch, split N
ways). The gap is the measured step minus that ideal; the measured step is the global batch divided by
the measured throughput, what the user sees. Each rank's timed step is tiled by the doctor into data
wait, compute, all-reduce and other time, and the time the training thread waited for a CPU is taken out
of whichever of these it fell in; a part of the gap is that part at N minus its ideal share of the base
run's (base / N of it). The parts tile the timed step of the rank that arrives last at the all-reduce
(`components`); what they do not hold is shown as unexplained: the difference between that step and the
step from the throughput (untimed steps on GPUs, the first step after validation, ranks whose steps
differ in length).
"""

from statistics import NormalDist

from .diagnosis import COMM_FIX, cpu_wait_cause
from .record import DoctorRecord

# A sweep point below this efficiency (speed-up / ideal speed-up) is never called healthy: its verdict
# names the largest part of its gap. 0.8: the share a well-fed data-parallel job on a fast interconnect
# keeps; below it, a fifth of the hardware is lost and one cause usually dominates.
EFFICIENCY_LINE = 0.8

# The parts, in the order shown: (label, verdict when it is the largest part).
PARTS = {
    "compute": ("compute that did not shrink", "compute-did-not-shrink"),
    "comm": ("gradient all-reduce (exposed)", "communication-bound"),
    "data": ("data wait (loader)", "data-bound"),
    "straggler": ("waiting for the slowest rank", "straggler"),
    "other": ("framework / other", "framework-overhead"),
    "cpu_wait": ("waiting for a CPU (host)", "host-contention"),
}


def global_batch(s: DoctorRecord) -> float:
    """Samples per optimizer step summed over the ranks (every micro-batch of the step)."""
    return sum(r.batch for r in s.ranks)


def step_ms(s: DoctorRecord) -> float:
    """The step as the user sees it: global batch / measured throughput, in ms."""
    return 1000 * global_batch(s) / s.samples_per_s if s.samples_per_s else 0.0


def components(s: DoctorRecord) -> dict[str, float]:
    """A run's step (ms) split into the parts of PARTS, along the critical path of a synchronous step.

    All ranks leave the all-reduce together, so the step is the last rank's: its own work (data wait +
    compute), its all-reduce, its other time. Data wait and compute are those of a typical rank (the
    lower median by own work), so that one slow rank does not inflate them; the last rank's extra work
    over the typical rank's is the straggler part, and so is what it waited in the all-reduce beyond
    the transfer (each step's least all-reduce of any rank: ranks take turns at arriving last, and the
    last rank on average still waited on the steps it was not). Waiting for a CPU is taken
    out of the part it fell in (the typical rank's data and busy time, the last rank's all-reduce, whose
    gloo threads wait on CPUs, and its other time). The parts add up to the last rank's timed step.
    """
    ranks = s.ranks
    last = min(ranks, key=lambda r: r.exposed_comm_ms)  # the last to arrive waits least (for others) in it
    typical = sorted(ranks, key=lambda r: r.work_ms)[(len(ranks) - 1) // 2]
    # Of its all-reduce, the transfer is each step's least; the rest it waited on steps it was not last.
    transfer = min(last.exposed_comm_ms, s.comm_transfer_ms)
    comm_wait = last.comm_cpu_wait_ms
    other_wait = last.cpu_wait_ms - last.data_cpu_wait_ms - last.busy_cpu_wait_ms - comm_wait
    return {
        "compute": typical.compute_ms - typical.busy_cpu_wait_ms,
        "comm": transfer,
        "data": typical.data_ms - typical.data_cpu_wait_ms,
        "straggler": last.work_ms - typical.work_ms + last.exposed_comm_ms - transfer,
        "other": last.other_ms - other_wait,
        "cpu_wait": typical.data_cpu_wait_ms + typical.busy_cpu_wait_ms + comm_wait + other_wait,
    }


def explain(base: DoctorRecord, run: DoctorRecord) -> dict:
    """The gap of `run` (N devices) against the ideal from `base` (fewer devices, same global batch)."""
    if abs(global_batch(base) - global_batch(run)) > 0.01 * global_batch(base):
        raise ValueError(
            f"not the same global batch ({global_batch(base):.0f} vs {global_batch(run):.0f} samples per step): "
            "the runs do not compare"
        )
    n0, n = base.world_size, run.world_size
    step0, step = step_ms(base), step_ms(run)
    ideal = step0 * n0 / n
    gap = step - ideal
    a, b = components(base), components(run)
    parts = {k: b[k] - a[k] * n0 / n for k in PARTS}
    speedup = step0 / step if step else 0.0
    efficiency = speedup * n0 / n
    largest = max(parts, key=lambda k: parts[k])
    e = {
        "devices": n,
        "base_devices": n0,
        "step_ms": step,
        "ideal_step_ms": ideal,
        "gap_ms": gap,
        "speedup": speedup,
        "efficiency": efficiency,
        "parts_ms": parts,
        "unexplained_ms": gap - sum(parts.values()),
        "largest": largest,
        "oversubscribed": run.oversubscribed,
    }
    if efficiency >= EFFICIENCY_LINE or gap <= 0:
        e["verdict"], e["fix"] = run.verdict, ""
    else:
        e["verdict"], e["fix"] = PARTS[largest][1], fix(largest, parts[largest], run)
    return e


def fix(part: str, ms: float, run: DoctorRecord) -> str:
    """What to do about the largest part of the gap; every fix keeps the global batch."""
    per_device = round(global_batch(run) / run.world_size)
    added = f"{ms:.1f} ms per step"
    if part == "compute":
        return (
            f"compute on {per_device} samples per device did not shrink with the batch ({added} above its ideal "
            "share): fixed per-step costs (kernel launches, Python, the optimizer step over all weights) do not "
            "split over devices → fewer devices for this global batch, more work per sample (a larger model), "
            "or cheaper fixed costs (torch.compile, fused optimizer)"
        )
    if part == "comm":
        return f"the gradient all-reduce ({run.grad_mb:.1f} MB) added {added} → {COMM_FIX}"
    if part == "data":
        return (
            f"waiting for the loader did not shrink ({added}): a per-batch cost, or a loader that a device's "
            f"smaller share does not speed up → --data.num_workers (now {run.num_workers}), "
            "persistent workers, pinned memory, cheaper loading (decode once, cache)"
        )
    if part == "straggler":
        slow = max(run.ranks, key=lambda r: r.work_ms)
        return (
            f"the ranks waited {added} in the all-reduce for the slowest (rank {slow.rank}) → check that "
            "rank's data shard and loader, its cores, other jobs or throttling on its device"
        )
    if part == "other":
        return (
            f"framework time per step grew ({added}: the loop's hooks, loggers, progress bar, per-step "
            "collectives) → log less often (--trainer.log_every_n_steps), no progress bar in batch jobs, "
            "no sync_dist on every step"
        )
    return (
        f"the training and all-reduce threads waited {added} for a CPU ({cpu_wait_cause(run)}) → ranks x "
        "(threads + loader workers) within the cores, with one spare for the all-reduce on CPUs "
        "(OMP_NUM_THREADS, fewer ranks per host), one rank per GPU, no other jobs on these cores"
    )


def format_explain(e: dict) -> str:
    """The decomposition as printed by scaling.py."""
    gap = e["gap_ms"]
    lines = [
        f"{e['devices']} device(s) against {e['base_devices']}: step {e['step_ms']:.1f} ms, ideal "
        f"{e['ideal_step_ms']:.1f} ms; speed-up {e['speedup']:.2f} of {e['devices'] / e['base_devices']:g}, "
        f"efficiency {e['efficiency']:.2f}",
        f"gap {gap:.1f} ms per step, by part (ms per step, % of the gap):",
    ]
    rows = [(PARTS[k][0], v) for k, v in e["parts_ms"].items()] + [("unexplained", e["unexplained_ms"])]
    for label, ms in rows:
        pct = f"{100 * ms / gap:5.0f}%" if gap > 0 else "    -"
        lines.append(f"  {label:<31} {ms:7.1f} ms {pct}")
    if e["oversubscribed"]:
        lines.append(f"  (oversubscribed: {e['oversubscribed']})")
    lines.append(f"verdict: {e['verdict']}" + (f": {e['fix']}" if e["fix"] else ""))
    return "\n".join(lines)


def ring_allreduce_ms(n: int, latency_ms: float, bandwidth_ms: float) -> float:
    """A ring all-reduce on n ranks: 2(n-1) hops of `latency_ms`/2 each, and 2(n-1)/n of the gradient through
    each link; `latency_ms` and `bandwidth_ms` are the two terms measured at 2 ranks (n=2 gives their sum)."""
    return (n - 1) * latency_ms + 2 * (n - 1) / n * bandwidth_ms


def expected_max(n: int) -> float:
    """Expected largest of n standard normal draws (Blom's approximation): how a rank's random lateness grows
    with the number of ranks that each may be late."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0


def predict(one: DoctorRecord, two: DoctorRecord, n: int) -> dict:
    """Step time and speed-up on n devices from runs on 1 and 2 (same global batch).

    Compute and data wait per device are fitted as fixed + per-sample x the per-device batch through the
    two runs; the framework's time per step is the 2-device run's; the all-reduce follows a ring: its fixed
    cost from the one-number all-reduce the doctor timed at 2 ranks, the rest grows as 2(n-1)/n; the
    straggler wait at 2 (the later rank's lead over the other) grows like the expected maximum of n ranks'
    jitter. Assumes each rank has its own device and cores (no time waiting for a CPU) and the same
    interconnect at n as at 2.
    """
    a, b = components(one), components(two)
    batch = global_batch(one)

    def fitted(part: str) -> float:
        per_sample = max(0.0, (a[part] - b[part]) / (batch - batch / 2))
        fixed = max(0.0, a[part] - per_sample * batch)
        return fixed + per_sample * batch / n

    latency = min(two.allreduce_latency_ms or 0.0, b["comm"])  # None: not measured, all bandwidth
    comm = ring_allreduce_ms(n, latency, b["comm"] - latency)
    straggler = b["straggler"] * expected_max(n) / (2 * expected_max(2))  # at 2: max - min = 2 x E[max]
    step = fitted("compute") + fitted("data") + b["other"] + comm + straggler
    base = step_ms(one) - a["cpu_wait"]  # the 1-device step without its wait for a CPU, likewise
    return {"devices": n, "step_ms": step, "speedup": base / step if step else 0.0, "comm_ms": comm}


def measured_without_cpu_wait(one: DoctorRecord, run: DoctorRecord) -> float:
    """The measured speed-up of `run` over `one` with each run's wait for a CPU taken out: what `predict`
    predicts (each rank on its own hardware)."""
    a, b = components(one), components(run)
    return (step_ms(one) - a["cpu_wait"]) / (step_ms(run) - b["cpu_wait"])
