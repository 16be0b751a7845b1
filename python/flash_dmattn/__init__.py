"""flash_dmattn: fused attention with a dynamic boolean mask and an additive bias.

    from flash_dmattn import flash_dmattn_func
    out = flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)

The torch names (flash_dmattn_func and the mask utilities) load torch on first use, so the package
imports without torch: flash_dmattn.core then runs the CPU reference on numpy arrays.
docs/python.md is the guide; docs/semantics.md the math.
"""
import importlib

from .core import available_backends, cuda_compiled, version

__version__ = version()

# name -> module that defines it; each needs torch.
_TORCH_NAMES = {
    "flash_dmattn_func": "interface",
    "prepare_mask": "interface",
    "PreparedMask": "interface",
    "flash_dmattn_varlen_func": "varlen",
    "flash_dmattn_with_kvcache": "kvcache",
    "attention_reference": "reference",
    "topk_indices": "masks",
    "topk_mask": "masks",
    "topk_key_indices": "masks",
    "relu_mask": "masks",
    "block_smooth": "masks",
    "create_mask": "masks",
    "pack_mask": "masks",
    "unpack_mask": "masks",
}

__all__ = ["available_backends", "cuda_compiled", "version", *_TORCH_NAMES]


def __getattr__(name):
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'flash_dmattn' has no attribute {name!r}")
    try:
        importlib.import_module("torch")
    except ImportError as error:
        raise ImportError(f"flash_dmattn.{name} needs PyTorch (pip install torch); flash_dmattn.core runs "
                          "numpy arrays without it") from error
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
