"""``model.quantization``: how a loaded model's weights are held, and putting them in.

* ``gguf``: a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K matrices stay as their blocks (packed for the
  native kernels, worker/models/quant_linear.py); everything else is dequantised.
* ``int8``: floats are loaded, then every linear weight is quantized per output
  channel to int8.
* ``none``: floats in ``model.dtype``, as before.
* ``auto``: ``gguf`` for a GGUF holding those formats, else ``none``.
* ``none`` is the default: the quantized route is opt-in until it is measured faster
  than the float one on the machines Folio serves from (README, Quantized weights).

Quantized weights run with float32 activations (the kernels' widening route, or a
dequantise-then-GEMM) unless ``worker.linear_backend: int8`` asks for int8 activations
(worker/models/linear_paths.py says why the measured choice leaves that route out).

The kernels are CPU kernels: on CUDA ``auto`` means ``none`` and the others are
refused; on a CPU where the native kernels cannot be built ``auto`` means ``none`` too
(a forced ``gguf``/``int8`` still runs, dequantising per call, slowly).
"""
from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_extension
from kernels.quant_linear import dequantize, pack_gguf_blocks
from observability.logging import get_logger
from worker.loader import LoadedModel
from worker.models.quant_linear import install_gguf_blocks, quantize_linears_int8

log = get_logger(__name__)


def quantization_for_device(requested: str, device: torch.device,
                            sharded: bool = False) -> str:
    """The ``model.quantization`` to load with on ``device`` (see the module docstring);
    ``sharded``: tensor parallelism, whose slices are cut from float weights."""
    if sharded:
        if requested in ("int8", "gguf"):
            raise ValueError(f"model.quantization={requested} is not served with "
                             f"parallel.tensor_parallel_size > 1; use auto or none")
        return "none"
    if device.type != "cpu":
        if requested in ("int8", "gguf"):
            raise ValueError(f"model.quantization={requested} runs on the CPU only; use "
                             f"auto or none on {device.type}")
        return "none"
    if requested == "auto" and not cpu_extension.is_available():
        log.info("quantized weights dequantised: native CPU kernels unavailable",
                 reason=cpu_extension.unavailable_reason())
        return "none"
    return requested


@torch.no_grad()
def load_weights(model: nn.Module, loaded: LoadedModel, device: torch.device,
                 dtype: torch.dtype) -> str:
    """Put ``loaded``'s weights into ``model`` (quantized as resolved), move it to
    ``device``/``dtype``; returns the quantization applied."""
    state_dict = loaded.state_dict
    if loaded.quantization == "gguf":
        blocks = dict(loaded.quantized)
        install_gguf_blocks(model, blocks)
        # matrices a layer could not keep (fused parts of different formats) as floats
        state_dict = {**state_dict, **{
            name: dequantize(pack_gguf_blocks(b.raw, b.ggml_type, b.shape[1])).to(dtype)
            for name, b in blocks.items()}}
    model.load_weights(state_dict)
    model.to(device=device, dtype=dtype).eval()
    if loaded.quantization == "int8":
        quantize_linears_int8(model)
    return loaded.quantization
