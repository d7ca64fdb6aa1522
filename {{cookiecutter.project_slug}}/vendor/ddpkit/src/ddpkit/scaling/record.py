"""The scaling doctor's output as one typed record: what doctor.py writes to doctor.json and what diagnosis.py,
gap.py and scaling.py read back, through the same two dataclasses.

One name per concept: `cpu_wait` is time a thread was ready to run but waited for a CPU (run-queue delay);
the verdict for too much of it is `host-contention`.
"""

from dataclasses import asdict, dataclass, field

# doctor.json's "schema", raised whenever a key or a number's meaning changes: runs compare only within one.
# 2: a step is an optimizer step (before, unversioned: a loader batch), micro-batches recorded.
# 3: one name per concept (`cpu_wait_*` for the four names of the wait for a CPU), read through this record.
SCHEMA = 3


class SchemaError(ValueError):
    """A doctor.json written by a ddpkit whose record means something else."""


@dataclass(kw_only=True)
class RankRecord:
    """One rank's numbers, per timed optimizer step (ms) unless said otherwise."""

    rank: int
    samples_per_s: float
    batch: float  # samples per optimizer step, every micro-batch of it
    micro_batches_per_step: float
    micro_batch_size: float
    step_ms: float
    data_ms: float  # in the loader's next()
    compute_ms: float  # forward, backward, optimizer: the busy part without the all-reduce
    comm_ms: float  # the span the all-reduce was in flight, its threads' wait for a CPU included
    other_ms: float
    work_ms: float  # data + compute: the rank's own work (comm includes waiting for others)
    # Without its waits for a CPU, which are the host's (host-contention), not a slower rank: the straggler
    # verdict reads this, so a loaded host is not called a straggler.
    own_work_ms: float
    # The training thread's wait for a CPU in the step plus the all-reduce threads' (comm_cpu_wait_ms); the
    # training thread's in its data wait and in its busy part.
    cpu_wait_ms: float
    data_cpu_wait_ms: float
    busy_cpu_wait_ms: float
    comm_cpu_wait_ms: float  # gloo's threads, while an all-reduce was in flight (0 on GPUs)
    gc_ms: float
    node_rank: int
    device_index: int  # -1 on the CPU
    peak_mem_mb: float

    @property
    def exposed_comm_ms(self) -> float:
        """The all-reduce without the time its threads waited for a CPU."""
        return self.comm_ms - self.comm_cpu_wait_ms

    @property
    def own_step_ms(self) -> float:
        """The step without the time the training thread waited for a CPU."""
        return self.step_ms - self.cpu_wait_ms


@dataclass(kw_only=True)
class DoctorRecord:
    """A run's report: the run's context, its totals and shares (% of the mean step), each rank's row and the
    findings. The context fields have defaults so that a record can be made from numbers alone (tests);
    the doctor always fills them."""

    schema: int = SCHEMA
    # -- context: the run, as the doctor saw it --
    ddpkit_version: str = ""  # the code behind these numbers and this verdict
    device: str = "cpu"  # the ranks' device type
    backend: str | None = None  # None: no process group (one process)
    comm_measured: bool = False  # the all-reduce was timed (--doctor.measure_comm); else it is in compute
    allreduce_latency_ms: float | None = None  # one-number all-reduce's median; None: comm not measured
    data_measured: bool = True  # False: this Lightning offers no hook around next(loader), data wait is 0
    grad_mb: float = 0.0
    num_workers: int | None = None  # None: the train loader has no such attribute
    pin_memory: bool | None = None  # None: likewise
    cpu_threads_per_rank: int = 1
    cpu_cores_visible: int = 0
    host_load_1min: float | None = None  # None: the OS offers no load average
    # Each timed step's least all-reduce of any rank, averaged; None: comm not measured or no step timed on all.
    comm_step_min_ms: float | None = None
    # -- totals and shares --
    world_size: int
    steps: int  # optimizer steps counted (after warm-up), the fewest of any rank
    micro_batches_per_step: float
    micro_batch_size: float
    samples_per_s: float
    samples_per_s_per_device: float
    steps_per_s: float
    step_ms: float
    data_wait_pct: float
    loader_wait_pct: float  # the data wait without its wait for a CPU, of the step without that wait
    cpu_wait_pct: float  # the training and all-reduce threads' wait for a CPU, of the step
    comm_transfer_ms: float  # the all-reduce without its threads' wait for a CPU or for a later rank
    comm_pct: float
    straggler_spread: float
    straggler_wait_pct: float
    memory_imbalance: float
    oversubscribed: str  # why the ranks must share hardware; "" when they need not
    ranks: list[RankRecord]
    # -- the diagnosis (diagnose, with these thresholds) --
    findings: list[dict[str, str]] = field(default_factory=list)  # {"cause", "fix"}, the first is the verdict
    verdict: str = ""
    thresholds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "this summary") -> "DoctorRecord":
        """The record of a doctor.json's content; SchemaError for another schema's (`source` names it)."""
        if data.get("schema") != SCHEMA:  # absent before schema 2
            raise SchemaError(
                f"{source} has schema {data.get('schema', 1)}, this ddpkit reads schema {SCHEMA}: "
                "fit that run again with this version"
            )
        return cls(**{**data, "ranks": [RankRecord(**r) for r in data["ranks"]]})
