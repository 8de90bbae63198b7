"""The tensor dtypes wsync speaks: safetensors dtype names ("BF16", "F32", ...), their item sizes,
and their torch and numpy counterparts. Used by the trainer side (wsync.trainer, wsync.megatron)
and the engine side (wsync.engine, wsync.adapters) alike; torch and numpy are imported only when
a function needs them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:
    import torch

# safetensors dtype names the agents accept, with their item sizes.
# F8_E4M3 is FP8 E4M3FN (torch.float8_e4m3fn; docs/spec/FP8.md): the codes of FP8 weights.
ITEMSIZE: Dict[str, int] = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4,
                            "I64": 8, "BOOL": 1, "F8_E4M3": 1}


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype of a safetensors dtype name ("BF16" -> torch.bfloat16, ...)."""
    import torch

    if name == "F8_E4M3":
        if not hasattr(torch, "float8_e4m3fn"):
            raise TypeError(f"F8_E4M3 needs a torch with float8_e4m3fn (2.1 or later); this is {torch.__version__}")
        return torch.float8_e4m3fn
    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
            "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
            "BOOL": torch.bool}[name]


def torch_dtype_name(t: "torch.Tensor") -> Optional[str]:
    """The safetensors dtype name of a torch tensor's dtype; None for a dtype wsync does not take."""
    import torch

    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
             torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
             torch.bool: "BOOL"}
    if hasattr(torch, "float8_e4m3fn"):  # torch 2.1 and later
        names[torch.float8_e4m3fn] = "F8_E4M3"
    return names.get(t.dtype)


def numpy_dtype(name: str) -> Any:
    """The numpy dtype of a safetensors dtype name; numpy has no bfloat16 or FP8, so BF16 is seen as
    its raw 16-bit patterns (uint16) and F8_E4M3 as its codes (uint8)."""
    import numpy as np

    return {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
            "U8": np.uint8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "BOOL": np.bool_,
            "F8_E4M3": np.uint8}[name]
