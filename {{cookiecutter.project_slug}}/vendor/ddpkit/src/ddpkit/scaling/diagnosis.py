"""The scaling doctor's analysis: from per-rank measurements to a summary, findings and a report.

Pure functions of numbers; the callback that measures them is `doctor.py` (the measurement itself: `measure.py`).
"""

from dataclasses import dataclass

from .record import DoctorRecord, RankRecord

# Per-rank numbers, gathered as one float64 row per rank, in this order.
FIELDS = (
    "steps",  # optimizer steps (one or more loader batches each)
    "wall_s",
    "samples",
    "timed_steps",
    "data_s",
    "busy_s",
    "comm_s",
    "step_s",
    "cpu_wait_s",  # run-queue wait of the training thread in the step, in its data wait, in its busy part
    "data_cpu_wait_s",
    "busy_cpu_wait_s",
    "gc_s",
    "comm_cpu_wait_s",  # run-queue wait of the other threads (gloo's on CPUs) while an all-reduce was in flight
    "micro_batches",  # loader batches (forward passes) in the steps: more than steps with gradient accumulation
    "node_rank",  # which machine (ranks on two nodes may both use their cuda:0)
    "device_index",  # -1 on the CPU
    "peak_mem_bytes",
)


@dataclass
class Thresholds:
    """When the doctor calls something a problem. Shares are of the mean step time; those of the loader and
    the straggler of the step without the time the training threads waited for a CPU (judged on its own).

    Args:
        min_step_ms: Steps shorter than this do too little work: fixed per-step costs (Python, kernel
            launches, all-reduce latency) dominate and more devices cannot help.
        straggler_wait_share: Flag a straggler when the fastest rank waits this share of each step for the
            slowest: the difference of their own work (data wait + compute), which the fast rank spends
            waiting in the all-reduce. (A ratio of work alone misfires when work is a small part of the step.)
        data_wait_share: Flag data-bound when the ranks wait this share of each step for the next batch
            (not counting the part of that wait in which the loading thread itself waited for a CPU, and
            of the step without the wait for a CPU).
        comm_share: Flag communication-bound when the all-reduce takes this share of the step: each step's
            least time of any rank in it (the last to arrive sees the transfer, not the others' lateness),
            without its threads' wait for a CPU.
        memory_imbalance: Flag when the largest per-rank peak memory is this many times the smallest.
        cpu_wait_share: Flag host contention when the training threads and the all-reduce's threads wait
            this share of each step for a CPU (ready to run, but every core busy: other processes, ranks x
            threads > cores, or on CPUs gloo's threads with no core of their own).
    """

    min_step_ms: float = 10.0
    straggler_wait_share: float = 0.25
    data_wait_share: float = 0.2
    comm_share: float = 0.3
    memory_imbalance: float = 1.3
    cpu_wait_share: float = 0.2


def covered_seconds(spans: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: all-reduces of buckets that overlap count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def summarize(rows: list[list[float]], context: dict) -> DoctorRecord:
    """Turn the gathered per-rank rows (FIELDS) into the report's numbers, per rank and overall; `context`
    holds the record's context fields (doctor.py's `_context`)."""
    ranks = []
    for rank, row in enumerate(rows):
        r = dict(zip(FIELDS, row, strict=True))
        timed = max(r["timed_steps"], 1.0)
        step_ms = 1000 * r["step_s"] / timed
        data_ms, busy_ms, comm_ms = (1000 * r[k] / timed for k in ("data_s", "busy_s", "comm_s"))
        waits = (1000 * r[k] / timed for k in ("cpu_wait_s", "data_cpu_wait_s", "busy_cpu_wait_s", "comm_cpu_wait_s"))
        cpu_wait_ms, data_cpu_wait_ms, busy_cpu_wait_ms, comm_cpu_wait_ms = waits
        ranks.append(
            RankRecord(
                rank=rank,
                samples_per_s=r["samples"] / r["wall_s"] if r["wall_s"] else 0.0,
                batch=r["samples"] / r["steps"] if r["steps"] else 0.0,
                micro_batches_per_step=r["micro_batches"] / r["steps"] if r["steps"] else 0.0,
                micro_batch_size=r["samples"] / r["micro_batches"] if r["micro_batches"] else 0.0,
                step_ms=step_ms,
                data_ms=data_ms,
                compute_ms=busy_ms - comm_ms,
                comm_ms=comm_ms,
                other_ms=step_ms - data_ms - busy_ms,
                work_ms=data_ms + busy_ms - comm_ms,
                own_work_ms=data_ms + busy_ms - comm_ms - data_cpu_wait_ms - busy_cpu_wait_ms,
                cpu_wait_ms=cpu_wait_ms + comm_cpu_wait_ms,
                data_cpu_wait_ms=data_cpu_wait_ms,
                busy_cpu_wait_ms=busy_cpu_wait_ms,
                comm_cpu_wait_ms=comm_cpu_wait_ms,
                gc_ms=1000 * r["gc_s"] / timed,
                node_rank=int(r["node_rank"]),
                device_index=int(r["device_index"]),
                peak_mem_mb=r["peak_mem_bytes"] / 2**20,
            )
        )
    step_ms = sum(r.step_ms for r in ranks) / len(ranks)
    own = sum(r.own_step_ms for r in ranks)  # summed over ranks
    total = sum(r.samples_per_s for r in ranks)
    work = [r.own_work_ms for r in ranks]
    mem = [r.peak_mem_mb for r in ranks]
    record = DoctorRecord(
        **context,
        world_size=len(ranks),
        steps=int(min(row[0] for row in rows)),
        micro_batches_per_step=sum(r.micro_batches_per_step for r in ranks) / len(ranks),
        micro_batch_size=sum(r.micro_batch_size for r in ranks) / len(ranks),
        samples_per_s=total,
        samples_per_s_per_device=total / len(ranks),
        steps_per_s=1000 / step_ms if step_ms else 0.0,
        step_ms=step_ms,
        data_wait_pct=100 * sum(r.data_ms for r in ranks) / len(ranks) / step_ms if step_ms else 0.0,
        # The data wait without its run-queue part (what the loader itself costs), as a share of the step
        # without the wait for a CPU: a loaded host stretches the step, not the loader's share of it.
        loader_wait_pct=100 * sum(r.data_ms - r.data_cpu_wait_ms for r in ranks) / own if own else 0.0,
        cpu_wait_pct=100 * sum(r.cpu_wait_ms for r in ranks) / len(ranks) / step_ms if step_ms else 0.0,
        comm_transfer_ms=0.0,  # below, with the context's comm_step_min_ms
        comm_pct=0.0,
        # The straggler's lead as a share of the step without the wait for a CPU: a loaded host stretches
        # the step, not the lead.
        straggler_spread=max(work) / min(work) if min(work) > 0 else 1.0,
        straggler_wait_pct=100 * (max(work) - min(work)) * len(ranks) / own if own else 0.0,
        memory_imbalance=max(mem) / min(mem) if min(mem) > 0 else 1.0,
        oversubscribed="",
        ranks=ranks,
    )
    # The all-reduce itself: the least-waiting rank's, or less where each step's own least is known (the
    # ranks take turns at arriving last; what the last rank of one step waited on another is jitter).
    transfer = min(r.exposed_comm_ms for r in ranks)
    if record.comm_step_min_ms is not None:
        transfer = min(transfer, record.comm_step_min_ms)
    # The all-reduce without its threads' wait for a CPU (that is host-contention), of the whole step.
    record.comm_transfer_ms, record.comm_pct = transfer, 100 * transfer / step_ms if step_ms else 0.0
    record.oversubscribed = oversubscription(record)
    return record


def oversubscription(s: DoctorRecord) -> str:
    """Why the ranks must share hardware, from the run's shape alone ('' when they need not): CPU ranks x
    threads (+ loader workers) beyond the visible cores, or two ranks on one GPU."""
    if s.device == "cpu":
        threads, cores, workers = s.cpu_threads_per_rank, s.cpu_cores_visible, s.num_workers or 0
        busy = s.world_size * (threads + workers)
        if cores and busy > cores:
            extra = f" + {workers} loader worker(s)" if workers else ""
            return f"{s.world_size} rank(s) x ({threads} thread(s){extra}) > {cores} CPU core(s)"
    devices = [(r.node_rank, r.device_index) for r in s.ranks if r.device_index >= 0]
    shared = sorted({d for d in devices if devices.count(d) > 1})
    if shared:
        return "ranks share GPU(s) " + ", ".join(f"{i} on node {node}" if node else str(i) for node, i in shared)
    return ""


def diagnose(s: DoctorRecord, t: Thresholds) -> list[dict[str, str]]:
    """Findings with their fix, most fundamental first; an empty list means healthy. Host contention comes
    last: the parts before it are judged without the wait for a CPU, it is what is left."""
    ranks = s.ranks
    if not s.step_ms:
        return [{"cause": "unmeasured", "fix": "no step after the warm-up steps was timed → train for more steps"}]
    found = []
    batch = round(ranks[0].batch)
    if s.memory_imbalance >= t.memory_imbalance:
        hi = max(ranks, key=lambda r: r.peak_mem_mb)
        lo = min(ranks, key=lambda r: r.peak_mem_mb)
        found.append(
            {
                "cause": "memory-imbalance",
                "fix": f"rank {hi.rank} peaks at {s.memory_imbalance:.1f}x the memory of rank {lo.rank} "
                f"({hi.peak_mem_mb:.0f} vs {lo.peak_mem_mb:.0f} MB) → a tensor is pinned to one device or "
                "kept on one rank only (rank-0-only state, torch.device('cuda') instead of the rank's own device)",
            }
        )
    if s.step_ms < t.min_step_ms:
        found.append(
            {
                "cause": "too-little-work",
                "fix": f"steps take {s.step_ms:.1f} ms (< {t.min_step_ms:g} ms): fixed per-step costs (Python, "
                "kernel launches, all-reduce latency) outweigh the work, so more devices cannot speed this up "
                f"→ use fewer devices for this global batch (each gets a larger share than {batch}), or more work "
                "per sample (a larger model); the global batch stays as it is",
            }
        )
    if s.straggler_wait_pct >= 100 * t.straggler_wait_share:
        slow = max(ranks, key=lambda r: r.own_work_ms)
        fast = min(ranks, key=lambda r: r.own_work_ms)
        found.append(
            {
                "cause": "straggler",
                "fix": f"rank {slow.rank} is a straggler: its own work takes {s.straggler_spread:.1f}x "
                f"rank {fast.rank}'s ({slow.own_work_ms:.1f} vs {fast.own_work_ms:.1f} ms per step), so the "
                f"others wait {s.straggler_wait_pct:.0f}% of each step for it → check that rank's data shard and "
                "loader, its CPU cores (cores per rank), and other jobs or throttling on its device",
            }
        )
    if s.loader_wait_pct >= 100 * t.data_wait_share:
        workers, pin = s.num_workers, s.pin_memory
        # A loader without these settings (ddpkit.data.streaming's: a new worker set per epoch) gets no advice on them.
        settings = "" if pin is None else f", set pin_memory=True (now {pin}) and persistent_workers=True"
        found.append(
            {
                "cause": "data-bound",
                "fix": f"{s.loader_wait_pct:.0f}% of each step waits for the loader → raise "
                f"--data.num_workers (now {workers}){settings}, or make loading cheaper (decode/augment once, "
                "cache, faster disk)",
            }
        )
    if s.comm_pct >= 100 * t.comm_share:
        found.append(
            {
                "cause": "communication-bound",
                "fix": f"the gradient all-reduce is {s.comm_pct:.0f}% of the step "
                f"({s.comm_transfer_ms:.1f} ms for {s.grad_mb:.1f} MB of gradients) → " + COMM_FIX,
            }
        )
    if s.cpu_wait_pct >= 100 * t.cpu_wait_share:
        found.append({"cause": "host-contention", "fix": cpu_wait_fix(s)})
    return found


# Fixes that keep the global batch (and so the training math): the project's promise is that adding
# devices changes the speed only, so no fix asks for more samples per step.
COMM_FIX = (
    "fewer devices for the same global batch (each all-reduce then carries more samples; with "
    "--data.micro_batch_size a device holds its larger share in micro-batches and all-reduces once per step), "
    "a compressing comm hook (bf16/fp16), DDP bucket_cap_mb to overlap the all-reduce with backward, or a "
    "faster interconnect"
)


def cpu_wait_cause(s: DoctorRecord) -> str:
    """Why the threads waited for a CPU, as far as the run's own numbers tell."""
    if s.oversubscribed:
        return s.oversubscribed
    comm_wait = sum(r.comm_cpu_wait_ms for r in s.ranks)
    if comm_wait >= 0.5 * sum(r.cpu_wait_ms for r in s.ranks) > 0:
        # Ranks on every core leave gloo's threads waiting for one even on an idle host (measured: ddp-template's
        # docs/measurements.md).
        return "mostly gloo's all-reduce threads, with every core taken by the ranks or other processes"
    return "other processes on the host"


def cpu_wait_fix(s: DoctorRecord) -> str:
    why = cpu_wait_cause(s)
    return (
        f"the training and all-reduce threads waited {s.cpu_wait_pct:.0f}% of each step for a CPU "
        f"({why}) → "
        "fewer torch threads per rank (OMP_NUM_THREADS) or loader workers so that ranks x (threads + workers) "
        "fit the cores (on CPUs with one to spare for the all-reduce), fewer ranks per host, or no other jobs "
        "on these cores; every other number here is inflated by this wait"
    )


def format_report(s: DoctorRecord) -> str:
    """The printed report: totals, one line per rank, the verdict and the fixes."""
    lines = [
        f"Scaling doctor: {s.world_size} x {s.device}, {s.steps} steps, "
        f"{s.micro_batches_per_step:g} micro-batch(es) of {s.micro_batch_size:g} samples per step and device, "
        f"{s.samples_per_s:.0f} samples/s ({s.samples_per_s_per_device:.0f} per device), "
        f"{s.steps_per_s:.1f} steps/s" + (f" (ddpkit {s.ddpkit_version})" if s.ddpkit_version else ""),
        f"host: {s.cpu_cores_visible} CPU cores, load {s.host_load_1min or 0:.1f}, "
        f"{s.cpu_threads_per_rank} torch threads per rank, {s.num_workers} loader workers per rank",
        "rank | samples/s | step ms | data ms | compute ms | comm ms | other ms | cpu wait ms | gc ms | peak MB",
    ]
    if not s.comm_measured:
        lines.append("comm not timed, counted in compute: --doctor.measure_comm true times it (costs ~1-2 ms/step)")
    for r in s.ranks:
        lines.append(
            f"{r.rank:>4} | {r.samples_per_s:>9.0f} | {r.step_ms:>7.2f} | {r.data_ms:>7.2f} | "
            f"{r.compute_ms:>10.2f} | {r.comm_ms:>7.2f} | {r.other_ms:>8.2f} | "
            f"{r.cpu_wait_ms:>11.2f} | {r.gc_ms:>5.2f} | {r.peak_mem_mb:>7.0f}"
        )
    # The comm column is the all-reduce's span; its share is of the transfer alone (no wait for a CPU, or for
    # a rank that came later on that step).
    transfer = f" ({s.comm_transfer_ms:.1f} ms transfer)" if s.comm_measured else ""
    lines.append(
        f"data wait {s.data_wait_pct:.0f}% (loader {s.loader_wait_pct:.0f}%) | "
        f"waiting for a CPU {s.cpu_wait_pct:.0f}% | comm {s.comm_pct:.0f}%{transfer} | straggler spread "
        f"{s.straggler_spread:.2f}x (fastest rank waits {s.straggler_wait_pct:.0f}%) | "
        f"memory imbalance {s.memory_imbalance:.2f}x"
    )
    if s.oversubscribed:
        lines.append(f"note: oversubscribed: {s.oversubscribed}: the ranks share hardware")
    load, cores = s.host_load_1min, s.cpu_cores_visible
    if load and cores and load > cores:
        lines.append(
            f"note: host load {load:.1f} > {cores} cores: other processes compete with the ranks for the CPU; "
            "'cpu wait' is the time this took from the training threads (host-contention above its threshold)"
        )
    if not s.findings:
        lines.append("verdict: healthy (no bottleneck above the thresholds)")
    for f in s.findings:
        lines.append(f"verdict: {f['cause']}: {f['fix']}")
    return "\n".join(lines)
