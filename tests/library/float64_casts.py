"""What a model still computes below float64 in a float64 step under the suite's KeepFloat64, as docs/measurements.md
ran it ("Models that cast down inside a float64 run"; not a test: transformers, timm and torchvision are not in
requirements.txt). One forward and backward of a tiny randomly initialized model per name, in float64 (the module
converted, float64 the default dtype, as Lightning's "64-true" does), under KeepFloat64; it prints the casts KeepFloat64
kept in float64 and every torch call of the model's code that still returned a tensor below float64, with its line.

    python tests/library/float64_casts.py hf:qwen2 hf:t5 timm:convnext_atto tv:swin_t

A line it prints is harmless when its values do not depend on the batch (positions, constants: they round the same
on any device count); one that carries the data is a false alarm waiting for the float64 checks.
"""

import collections
import inspect
import sys

import torch
import torch.nn.functional as F
from ddpkit.testing.float64 import TORCH_DIR, KeepFloat64
from torch import Tensor
from torch.overrides import TorchFunctionMode

V = 256  # vocabulary of the text models


class BelowFloat64(TorchFunctionMode):
    """Counts (function, dtype, file:line of the model's code) for every call that returns a floating tensor below
    float64. Entered outside KeepFloat64, so it sees the calls as KeepFloat64 lets them through."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, tuple | list) else (out,):
            if isinstance(o, Tensor) and o.is_floating_point() and o.dtype != torch.float64:
                frame = inspect.currentframe().f_back
                while frame is not None and (
                    frame.f_code.co_filename.startswith(TORCH_DIR) or frame.f_code.co_filename.endswith("float64.py")
                ):
                    frame = frame.f_back
                where = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}" if frame else "?"
                self.seen[(getattr(func, "__name__", str(func)), str(o.dtype), where)] += 1
        return out


LM = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
GQA = dict(LM, num_key_value_heads=2, attn_implementation="eager")
ENC_DEC = dict(vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128)  # fmt: skip
T5 = dict(vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0,
          pad_token_id=0)  # fmt: skip
STAGES = dict(hidden_sizes=[16, 32], depths=[1, 1], num_labels=3)
# name: (transformers model class, its config class, the config's arguments, the kind of batch)
# fmt: off
HF = {
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", GQA, "lm"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(GQA, head_dim=16), "lm"),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(GQA, head_dim=16), "lm"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(GQA, head_dim=16), "lm"),
    "mistral": ("MistralForCausalLM", "MistralConfig", GQA, "lm"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(GQA, pad_token_id=0), "lm"),
    "llama": ("LlamaForCausalLM", "LlamaConfig", GQA, "lm"),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(LM, attn_implementation="eager"), "lm"),
    "opt": ("OPTForCausalLM", "OPTConfig", dict(vocab_size=V, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                                num_attention_heads=4, word_embed_proj_dim=64), "lm"),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(vocab_size=V, hidden_size=64, n_layer=2, n_head=4), "lm"),
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(vocab_size=V, hidden_size=64, num_hidden_layers=2,
                                                         num_attention_heads=4), "lm"),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4), "lm"),
    "bert": ("BertForSequenceClassification", "BertConfig", dict(LM, num_labels=3), "cls"),
    "roberta": ("RobertaForSequenceClassification", "RobertaConfig", dict(LM, num_labels=3, pad_token_id=1), "cls"),
    "deberta_v2": ("DebertaV2ForSequenceClassification", "DebertaV2Config", dict(LM, num_labels=3), "cls"),
    "distilbert": ("DistilBertForSequenceClassification", "DistilBertConfig", dict(vocab_size=V, dim=64,
                   hidden_dim=128, n_layers=2, n_heads=4, num_labels=3), "cls"),
    "bart": ("BartForConditionalGeneration", "BartConfig", ENC_DEC, "s2s"),
    "t5": ("T5ForConditionalGeneration", "T5Config", T5, "s2s"),
    "mt5": ("MT5ForConditionalGeneration", "MT5Config", T5, "s2s"),
    "whisper": ("WhisperForConditionalGeneration", "WhisperConfig", dict(ENC_DEC, num_mel_bins=16,
                max_source_positions=16, decoder_start_token_id=1, pad_token_id=0), "audio"),
    "vit": ("ViTForImageClassification", "ViTConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, image_size=32, patch_size=8, num_labels=3), "img"),
    "swin": ("SwinForImageClassification", "SwinConfig", dict(image_size=32, patch_size=4, embed_dim=16,
             depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=3), "img"),
    "convnext": ("ConvNextForImageClassification", "ConvNextConfig", dict(STAGES, num_stages=2), "img"),
    "convnextv2": ("ConvNextV2ForImageClassification", "ConvNextV2Config", dict(STAGES, num_stages=2), "img"),
    "resnet": ("ResNetForImageClassification", "ResNetConfig", dict(STAGES, embedding_size=16), "img"),
}
# fmt: on


def build(name: str):
    library, _, model = name.partition(":")
    if library == "hf":
        import transformers

        model_class, config_class, config, kind = HF[model]
        return getattr(transformers, model_class)(getattr(transformers, config_class)(**config)), kind
    if library == "timm":
        import timm

        sized = any(k in model for k in ("vit", "swin", "deit", "eva"))  # the patch models take the image size
        return timm.create_model(model, num_classes=3, **({"img_size": 32} if sized else {})), "img"
    if library == "tv":
        import torchvision

        return torchvision.models.get_model(model, num_classes=3), "img"
    raise SystemExit(f"error: {name}: expected hf:NAME, timm:NAME or tv:NAME")


def batch(kind: str) -> dict[str, Tensor]:
    """A padded or masked batch of 4 where the kind has one (the masks carry the data's shape into the math)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (4, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    labels = torch.tensor([0, 1, 2, 1])
    if kind == "lm":
        return dict(input_ids=ids, attention_mask=mask, labels=ids)
    if kind == "cls":
        return dict(input_ids=ids, attention_mask=mask, labels=labels)
    if kind == "s2s":
        target = ids[:, :8].clone()
        target[0, 6:] = -100
        return dict(input_ids=ids[:, 4:], labels=target)
    if kind == "audio":
        return dict(input_features=torch.randn(4, 16, 32, generator=g), labels=ids[:, :6])
    return dict(pixel_values=torch.randn(4, 3, 32, 32, generator=g), labels=labels)


def probe(name: str) -> None:
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        model, kind = build(name)
        model = model.double().train()
        inputs = {k: v.double() if v.is_floating_point() else v for k, v in batch(kind).items()}
        below, keep = BelowFloat64(), KeepFloat64()
        with below, keep:
            if hasattr(model, "config"):  # transformers: the model's own loss
                loss = model(**inputs).loss
            else:
                loss = F.cross_entropy(model(inputs["pixel_values"]), inputs["labels"])
            loss.backward()
    finally:
        torch.set_default_dtype(torch.float32)
    print(f"{name}: loss in {loss.dtype}; kept in float64: {keep.casts or 'nothing'}")
    for (func, dtype, where), n in sorted(below.seen.items(), key=lambda kv: -kv[1]):
        print(f"    below float64: {func} -> {dtype} at {where} ({n} x)")


if __name__ == "__main__":
    for name in sys.argv[1:]:
        probe(name)
