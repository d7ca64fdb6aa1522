"""DDP with a short collective timeout that still lets slow starts meet; the strategy names that are plain DDP."""

from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from ..lightning_internals import CurrentStreamDDPStrategy, ddp_timeout, set_ddp_timeout, set_process_group_timeout


class TimedDDPStrategy(CurrentStreamDDPStrategy):
    """DDP whose collectives fail after `timeout`, while starting ranks get `startup_timeout` to meet.

    One timeout for both would make a short hang-detection timeout fail slow
    start-ups (imports on a busy machine, many nodes), or a long one hide hangs.
    The model is wrapped on the CUDA stream its steps run on (`CurrentStreamDDPStrategy`), not on Lightning's side
    stream, so no backward waits on a stream it did not need.
    """

    def __init__(self, *args: Any, startup_timeout: timedelta = timedelta(minutes=10), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.startup_timeout = startup_timeout

    def setup_distributed(self) -> None:
        timeout = ddp_timeout(self)
        if timeout is None:
            return super().setup_distributed()
        set_ddp_timeout(self, max(timeout, self.startup_timeout))
        try:
            super().setup_distributed()
        finally:
            set_ddp_timeout(self, timeout)
        set_process_group_timeout(timeout)


def ddp_alias(name: str) -> dict | None:
    """The DDPStrategy arguments a registered strategy name stands for ("ddp", "ddp_spawn",
    "ddp_find_unused_parameters_true", ...), or None when the name is not a plain DDPStrategy."""
    entry = StrategyRegistry[name] if name in StrategyRegistry else None
    return dict(entry["init_params"]) if entry is not None and entry["strategy"] is DDPStrategy else None
