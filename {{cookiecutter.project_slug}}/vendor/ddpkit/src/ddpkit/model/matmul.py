"""TF32 matrix multiplications on GPUs for float32 training: what the CLI's `--float32_matmul_precision` sets.

torch multiplies float32 matrices in full float32 unless told otherwise ("highest"). "high" lets GPUs with TF32
tensor cores (NVIDIA Ampere and later) round the inputs to 10 mantissa bits (a relative error of at most 2**-11
each) and accumulate in float32, on tensor cores. Older GPUs and CPUs compute as before whatever the setting.
Lightning prints its own advice to set it when a run starts on such a GPU with "highest"; once set, it is quiet.
"""

import torch

CHOICES = ("auto", "highest", "high", "medium")
# Precisions whose matmuls run (some or all) in float32: autocast leaves the ones outside it in float32.
TF32_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


def float32_matmul_precision(setting: str, precision: str, device: torch.device) -> str | None:
    """The precision to give `torch.set_float32_matmul_precision` for a run, or None to leave torch's as it is.

    `setting` "auto": "high" for a float32 or mixed-precision run on a CUDA device, nothing otherwise (a CPU run; a
    float64 run, which has no float32 matmul and is the reference of the parity checks: it stays exactly as it was).
    Any other setting is torch's own name and is set as given.
    """
    if setting not in CHOICES:
        raise ValueError(f"float32_matmul_precision must be one of {CHOICES}, got {setting!r}")
    if setting != "auto":
        return setting
    return "high" if device.type == "cuda" and precision in TF32_PRECISIONS else None
