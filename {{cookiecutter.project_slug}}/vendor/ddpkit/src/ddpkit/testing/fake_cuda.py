"""GPUs where there are none, for the tests only: CUDA-tagged checkpoints, and CUDA visibility as the CLI sees it.

- `tagged_as_cuda()`: inside it, `torch.save` tags every tensor `cuda:0`, as a checkpoint written on a GPU is;
  loading it without a map location on a machine with no GPU fails as it would.
- `FAKE_CUDA_DEVICES=N` with `fake_env`'s sitecustomize on PYTHONPATH (it calls `install`) makes
  `torch.cuda.is_available()` / `device_count()` report N GPUs in a subprocess: the checks that only read
  them (the CLI's refusals, the preflight's early exit) take their GPU branches; nothing can run on them.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.serialization import register_package

_tag_as_cuda = False


def _tagger(obj: Any) -> str | None:
    return "cuda:0" if _tag_as_cuda and obj.device.type == "cpu" else None


register_package(0, _tagger, lambda obj, location: None)  # tags only inside tagged_as_cuda; never loads


@contextmanager
def tagged_as_cuda() -> Iterator[None]:
    """Inside it, `torch.save` tags every CPU tensor as stored on `cuda:0`."""
    global _tag_as_cuda
    _tag_as_cuda = True
    try:
        yield
    finally:
        _tag_as_cuda = False


def install() -> None:
    """Report FAKE_CUDA_DEVICES GPUs to code that asks torch.cuda whether and how many (no-op when unset)."""
    count = os.environ.get("FAKE_CUDA_DEVICES")
    if count is None:
        return
    torch.cuda.is_available = lambda: int(count) > 0
    torch.cuda.device_count = lambda: int(count)


# Run at every interpreter start-up (its directory on PYTHONPATH); imports torch only when asked to.
SITECUSTOMIZE = """
import os
if "FAKE_CUDA_DEVICES" in os.environ:
    from ddpkit.testing import fake_cuda
    fake_cuda.install()
"""


def fake_env(site: Path, gpus: int) -> dict[str, str]:
    """Environment for a subprocess that sees `gpus` GPUs; `site` is a directory for the start-up hook."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = [str(site), os.environ.get("PYTHONPATH", "")]
    return {"FAKE_CUDA_DEVICES": str(gpus), "PYTHONPATH": os.pathsep.join(filter(None, path))}
