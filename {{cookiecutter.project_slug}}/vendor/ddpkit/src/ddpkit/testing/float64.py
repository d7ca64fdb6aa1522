"""Keeps the suite's float64 runs in float64 where a model casts down, and records where it did.

A float64 run is the suite's exact reference only if every step of the model computes in float64. Some models cast
down on purpose: Hugging Face's `T5LayerNorm` takes its variance in float32 (`hidden_states.to(torch.float32)`), the
RMSNorm of LLaMA-style models casts to float32 and back, their attention takes `softmax(..., dtype=torch.float32)`
and their loss `logits.float()`. A "64-true" run of such a model carries float32's rounding (1e-8 after training),
and 1 vs 2 devices then differ by it while the float64 checks judge at float64's (1e-12). Widening the bounds to
float32's would let through the bugs they are there to catch; instead, in the suite's float64 runs, the callback
`Float64Throughout` turns each cast of a float64 tensor to a lower floating type in the model's code into a copy in
float64, and writes where it did (probe/float64-casts.json) for the session's summary:
"T5LayerNorm casts float64 to float32 inside the float64 runs: the suite keeps it in float64 (Float64Throughout)".

The model's code is any code outside torch, Lightning, torchmetrics and ddpkit: their casts are deliberate (the
probe hashes samples as float32; torchmetrics keeps its sums in their own dtype) and stay as they are. Both sides of
every comparison run under the same callback, so nothing is judged against a run that rounds otherwise. A region
compiled by torch.compile may keep its casts: a compiled kernel does not call back into Python.
"""

import inspect
import json
from importlib.util import find_spec
from pathlib import Path

import lightning as L
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

LOWER = (torch.float32, torch.float16, torch.bfloat16)
# Whose casts stay as they are: the frameworks' and the suite's own (their packages' folders).
OWN = tuple(
    str(Path(folder)) + "/"
    for name in ("lightning", "lightning_fabric", "torchmetrics", "ddpkit")
    for folder in (find_spec(name).submodule_search_locations or ())
)
TORCH_DIR = str(Path(torch.__file__).parent) + "/"
DOWN = {Tensor.float: torch.float32, Tensor.half: torch.float16, Tensor.bfloat16: torch.bfloat16}


def _target(func, args: tuple, kwargs: dict) -> torch.dtype | None:
    """The floating dtype a call casts its first argument, a float64 tensor, to, if it names one."""
    if func in DOWN:
        return DOWN[func]
    if func is Tensor.type_as:
        return args[1].dtype
    named = kwargs.get("dtype")
    if func is Tensor.to or func is Tensor.type:  # a positional dtype or, for `to`, another tensor's
        named = next(
            (a.dtype if isinstance(a, Tensor) else a for a in args[1:] if isinstance(a, Tensor | torch.dtype)), named
        )
    return named if func is not Tensor.view else None  # view(dtype) reinterprets the bits: not a cast


def _kept(func, args: tuple, kwargs: dict) -> Tensor:
    """The call with float64 in place of the lower type: a new tensor, as the cast would have made."""
    self = args[0]
    if func in DOWN or func is Tensor.type_as:
        return self.to(torch.float64, copy=True, **kwargs)
    if func is Tensor.to:  # to(dtype, ...), to(device, dtype, ...), to(other, ...), to(dtype=...)
        rest = [x for a in args[1:] for x in ((a.device, torch.float64) if isinstance(a, Tensor) else (a,))]
        args = (self, *rest)
    args = tuple(torch.float64 if isinstance(a, torch.dtype) else a for a in args)
    kwargs = {k: torch.float64 if isinstance(v, torch.dtype) else v for k, v in kwargs.items()}
    out = func(*args, **kwargs)
    return out.clone() if out is self else out


def _caller(frame):
    """The first frame outside torch (a call through torch.nn.functional is its caller's)."""
    while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
        frame = frame.f_back
    return frame


def _site(frame) -> tuple[bool, str]:
    """For the first frame outside torch: (whether it is the model's code, the module it is in: the innermost `self`
    that is an nn.Module, else that frame's function)."""
    if frame is None or frame.f_code.co_filename.startswith(OWN):
        return False, ""
    caller = frame
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_varnames[:1] == ("self",) else None
        if isinstance(owner, torch.nn.Module):
            return True, type(owner).__name__
        frame = frame.f_back
    return True, getattr(caller.f_code, "co_qualname", caller.f_code.co_name)


class KeepFloat64(TorchFunctionMode):
    """While active, a cast of a float64 tensor to float32, float16 or bfloat16 in the model's code (`.to`, `.float`,
    `.half`, `.bfloat16`, `.type`, `.type_as`, a `dtype=` argument such as softmax's) returns float64 instead.
    `casts`: {module or function: {dtype it cast to: calls}}."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: dict[str, dict[str, int]] = {}
        self.sites: dict[tuple[str, int], tuple[bool, str]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if not (isinstance(first, Tensor) and first.dtype == torch.float64):
            return func(*args, **kwargs)
        target = _target(func, args, kwargs)
        if target not in LOWER or torch.compiler.is_compiling():
            return func(*args, **kwargs)
        caller = _caller(inspect.currentframe().f_back)
        key = (caller.f_code.co_filename, caller.f_lineno) if caller is not None else ("", 0)
        if key not in self.sites:
            self.sites[key] = _site(caller)
        ours, where = self.sites[key]
        if not ours:
            return func(*args, **kwargs)
        counts = self.casts.setdefault(where, {})
        name = str(target).removeprefix("torch.")
        counts[name] = counts.get(name, 0) + 1
        return _kept(func, args, kwargs)


class Float64Throughout(L.Callback):
    """Runs fit, validate, test and predict of a "64-true" run under KeepFloat64 (nothing in other precisions);
    rank 0 writes where it kept float64 to <default_root_dir>/probe/float64-casts.json."""

    def __init__(self) -> None:
        self.mode: KeepFloat64 | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.precision == "64-true" and self.mode is None:
            self.mode = KeepFloat64()
            self.mode.__enter__()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Lightning calls no teardown hook after an exception: the mode would stay active in the process (the suite
        # runs its probes' fits in the pytest process itself).
        self.teardown(trainer, pl_module, "")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.mode is None:
            return
        self.mode.__exit__(None, None, None)
        if trainer.global_rank == 0:
            out = Path(trainer.default_root_dir) / "probe"
            out.mkdir(parents=True, exist_ok=True)
            (out / "float64-casts.json").write_text(json.dumps(self.mode.casts, indent=1))
        self.mode = None


def summary(casts: dict[str, dict[str, int]]) -> list[str]:
    """One line per module that cast down in a float64 run, for the session's summary."""
    return [
        f"{where} casts float64 to {', '.join(sorted(to))} inside the float64 runs: the suite keeps it in float64"
        " (Float64Throughout)"
        for where, to in sorted(casts.items())
    ]
