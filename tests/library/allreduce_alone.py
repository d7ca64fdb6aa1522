"""The all-reduce alone, outside any training: the independent measurement the doctor's comm part is checked
against (test_scaling_gap.py).

    torchrun --standalone --nproc_per_node 2 tests/library/allreduce_alone.py MB [MB ...]

Each rank all-reduces a float32 tensor of each size over gloo as DDP's default comm hook does (divide by
the world size, all-reduce asynchronously, a callback when it completes), 3 times to warm up, then `REPS`
times, each after a barrier (so that no rank waits for another inside the timed call). Each time less the
time the process's threads waited for a CPU meanwhile (Linux schedstat; gloo's threads find the cores
busy on a loaded host), as the doctor counts it. Rank 0 prints one JSON line: {"MB": median ms, ...}.
"""

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from alone import waited_s

REPS = 15


def main(sizes_mb: list[float]) -> None:
    dist.init_process_group("gloo")
    medians = {}
    for mb in sizes_mb:
        tensor = torch.zeros(max(1, int(mb * 2**18)))  # 2**18 float32 = 1 MB
        times = []
        for rep in range(3 + REPS):
            dist.barrier()
            waited = waited_s(all_threads=True)
            start = time.perf_counter()
            tensor.div_(dist.get_world_size())
            dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()).wait()
            span = time.perf_counter() - start
            waited = min(max(0.0, waited_s(all_threads=True) - waited), span)  # summed over threads: at most the span
            if rep >= 3:
                times.append(1000 * (span - waited))
        medians[str(mb)] = statistics.median(times)
    if dist.get_rank() == 0:
        print(json.dumps(medians))
    dist.destroy_process_group()


if __name__ == "__main__":
    main([float(a) for a in sys.argv[1:]])
