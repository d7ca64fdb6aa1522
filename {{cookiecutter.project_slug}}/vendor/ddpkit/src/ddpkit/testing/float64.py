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

A kernel that has no float64 version would stop the run instead: torch's grouped matrix product (`torch._grouped_mm`,
float32 and lower only), which Hugging Face's mixture-of-experts layers (Mixtral, Qwen-MoE, OLMoE; transformers 5's
default `experts_implementation="grouped_mm"`) call for their experts, raised "Expected mat_a to be Float32, BFloat16
or Float16 matrix, got Double" in the suite's first float64 run. Under the same callback it is computed in float64 as
what it is, one matrix product per group, and recorded the same way. That, and the casts of a forward that activation
checkpointing recomputes during the backward pass (where torch activates no function mode), happen at the
dispatcher's level (`KeepFloat64Dispatch`, active beside `KeepFloat64`).
"""

import inspect
import json
from importlib.util import find_spec
from pathlib import Path

import lightning as L
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..lightning_internals import TorchDispatchMode, grouped_mm_operator

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
    """The first frame outside torch and this module (a call through torch.nn.functional is its caller's; an operator
    that KeepFloat64 let through reaches KeepFloat64Dispatch from KeepFloat64's frame)."""
    while frame is not None and (
        frame.f_code.co_filename.startswith(TORCH_DIR) or frame.f_code.co_filename == __file__
    ):
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


def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor | None = None, bias=None, out_dtype=None) -> Tensor | None:
    """torch._grouped_mm in float64, as one product per group, for the layouts of a mixture of experts and of its
    gradient: tokens sorted by expert (a: tokens x in, b: experts x in x out, offs: each group's end row; rows past
    the last end stay 0), the weights' gradient (a: in x tokens, b: tokens x out, offs over the tokens: experts x in x
    out) and batched (both 3-d, no offs). None for another layout, a bias or an output dtype: torch's then."""
    if bias is not None or out_dtype not in (None, torch.float64):
        return None
    if a.dim() == 3 and b.dim() == 3 and offs is None:
        return torch.bmm(a, b)
    if offs is None or a.dim() != 2 or b.dim() not in (2, 3):
        return None
    ends = offs.tolist()
    spans = list(zip([0, *ends[:-1]], ends, strict=True))
    if b.dim() == 2:
        return torch.stack([a[:, start:end] @ b[start:end] for start, end in spans])
    rows = [a[start:end] @ b[g] for g, (start, end) in enumerate(spans)]
    return torch.cat([*rows, a.new_zeros(a.shape[0] - ends[-1], b.shape[2])])


# The dispatcher's operators with no float64 kernel, and their float64 computation (torch < 2.8 has no grouped
# product).
NO_FLOAT64 = {op: _grouped_mm for op in [grouped_mm_operator()] if op is not None}


class KeepFloat64(TorchFunctionMode):
    """While active, a cast of a float64 tensor to float32, float16 or bfloat16 in the model's code (`.to`, `.float`,
    `.half`, `.bfloat16`, `.type`, `.type_as`, a `dtype=` argument such as softmax's) returns float64 instead.
    `casts`: {module or function: {dtype it cast to, or a kernel KeepFloat64Dispatch computed: calls}}."""

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
        if not self.record(inspect.currentframe().f_back, str(target).removeprefix("torch.")):
            return func(*args, **kwargs)
        return _kept(func, args, kwargs)

    def record(self, frame, name: str) -> bool:
        """Count `name` (a dtype cast to, or a kernel) under the module that called it, if that is the model's code."""
        caller = _caller(frame)
        key = (caller.f_code.co_filename, caller.f_lineno) if caller is not None else ("", 0)
        if key not in self.sites:
            self.sites[key] = _site(caller)
        ours, where = self.sites[key]
        if ours:
            counts = self.casts.setdefault(where, {})
            counts[name] = counts.get(name, 0) + 1
        return ours


class KeepFloat64Dispatch(TorchDispatchMode):
    """What KeepFloat64 cannot do as a function mode, at the dispatcher's level, recorded into its record:

    - a kernel with no float64 version (NO_FLOAT64) computes in float64, in the forward and in its own gradient's
      backward (torch's derivative of the grouped product calls it again);
    - during a backward pass torch activates no function mode, only dispatch modes: a forward that activation
      checkpointing recomputes there (torch.utils.checkpoint; Hugging Face's `gradient_checkpointing`) must cast as
      the forward did, or checkpoint stops ("Recomputed values ... have different metadata"). An operator's `dtype=`
      below float64 from the model's code keeps float64 (every spelling of a cast arrives as `_to_copy`); in the
      forward, KeepFloat64 has already turned those into float64.
    """

    def __init__(self, forward: KeepFloat64) -> None:
        super().__init__()
        self.forward = forward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if not (isinstance(first, Tensor) and first.dtype == torch.float64):
            return func(*args, **kwargs)
        if func in NO_FLOAT64 and (out := NO_FLOAT64[func](*args, **kwargs)) is not None:
            self.forward.record(inspect.currentframe().f_back, func.overloadpacket.__name__)
            return out
        target = kwargs.get("dtype")
        if target in LOWER and self.forward.record(inspect.currentframe().f_back, str(target).removeprefix("torch.")):
            return func(*args, **{**kwargs, "dtype": torch.float64})
        return func(*args, **kwargs)


class Float64Throughout(L.Callback):
    """Runs fit, validate, test and predict of a "64-true" run under KeepFloat64 and KeepFloat64Dispatch (nothing in
    other precisions); rank 0 writes where they kept float64 to <default_root_dir>/probe/float64-casts.json."""

    def __init__(self) -> None:
        self.mode: KeepFloat64 | None = None
        self.dispatch: KeepFloat64Dispatch | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.precision == "64-true" and self.mode is None:
            self.mode = KeepFloat64()
            self.mode.__enter__()
            self.dispatch = KeepFloat64Dispatch(self.mode)
            self.dispatch.__enter__()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Lightning calls no teardown hook after an exception: the mode would stay active in the process (the suite
        # runs its probes' fits in the pytest process itself).
        self.teardown(trainer, pl_module, "")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.mode is None:
            return
        self.dispatch.__exit__(None, None, None)
        self.mode.__exit__(None, None, None)
        if trainer.global_rank == 0:
            out = Path(trainer.default_root_dir) / "probe"
            out.mkdir(parents=True, exist_ok=True)
            (out / "float64-casts.json").write_text(json.dumps(self.mode.casts, indent=1))
        self.mode = None


def summary(casts: dict[str, dict[str, int]]) -> list[str]:
    """One line per module that cast down, or called a kernel with no float64 version, in a float64 run, for the
    session's summary."""
    lines = []
    for where, names in sorted(casts.items()):
        to = ", ".join(sorted(name for name in names if not name.startswith("_")))
        kernels = ", ".join(f"torch.{name}" for name in sorted(names) if name.startswith("_"))
        if to:
            lines.append(f"{where} casts float64 to {to} inside the float64 runs: the suite keeps it in float64")
        if kernels:
            lines.append(
                f"{where} calls {kernels}, which has no float64 kernel: the suite's float64 runs compute it in "
                "float64, one matrix product per group"
            )
    return [f"{line} (Float64Throughout)" for line in lines]
