"""bf16 weights prepacked for oneDNN: the ``mkldnn`` linear path.

``F.linear`` on a bf16 weight hands oneDNN the ``[out, in]`` tensor as stored, and
oneDNN reorders it into its blocked (AMX/VNNI) layout inside every call: on an AMX Xeon
that reorder cost as much as the product. Reordered once at load
(``torch.ops.mkldnn._reorder_linear_weight``) and multiplied with
``torch.ops.mkldnn._linear_pointwise``, the same oneDNN kernels give the same bits
(the product is not changed, only where the weight's reorder happens) 1.3-2x faster at
1-64 rows on an AMX Xeon; at 2,048-row prefill chunks one session measured 2.7x
(SmolLM2's gate/up projection) and a later one 1.0-1.5x, which is why the choice is
timed per machine rather than assumed.

The packed copy sits beside the weight (an attribute of the parameter object, never a
parameter itself, so state dicts, weight updates and sleep mode see the weight as it
was): it costs one more copy of every bf16 weight the measured choice
(worker/linear_backend.py) runs this way, and :func:`packed` rebuilds it whenever the
weight's storage or version counter moved (``copy_`` of a weight update, sleep mode's
reload), so it never goes stale.
"""
from __future__ import annotations

import functools

import torch

_ATTR = "_folio_prepacked"  # (data_ptr, version, packed tensor) on the weight object


@functools.cache
def available() -> bool:
    """Whether this torch build and CPU run oneDNN's bf16 linear (AVX512-BF16/AMX)."""
    try:
        return (torch.backends.mkldnn.is_available()
                and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    except (AttributeError, RuntimeError):
        return False


def takes(weight, dtype: torch.dtype | None = None) -> bool:
    """Whether the ``mkldnn`` path can run this weight for activations of ``dtype``
    (None: any): a 2-D bf16 CPU tensor, bf16 activations."""
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2
            and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.numel() > 0 and dtype in (None, torch.bfloat16) and available())


def packed(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in oneDNN's layout, reordered once and kept until the weight changes."""
    key = (weight.data_ptr(), weight._version)
    held = getattr(weight, _ATTR, None)
    if held is not None and held[:2] == key:
        return held[2]
    setattr(weight, _ATTR, None)  # the stale copy goes before the new one is made
    with torch.no_grad():
        # the batch-size hint only tunes the blocking; the packed weight takes any rows
        fresh = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
    setattr(weight, _ATTR, (*key, fresh))
    return fresh


def has_packed(weight) -> bool:
    return getattr(weight, _ATTR, None) is not None


def drop(weight) -> None:
    """Free ``weight``'s packed copy (a layer that does not run this path, sleep)."""
    if getattr(weight, _ATTR, None) is not None:
        setattr(weight, _ATTR, None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` through the packed weight, in bf16."""
    k, n = weight.shape[1], weight.shape[0]
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, k).contiguous(), packed(weight),
                                             bias, "none", [], "")
    return out.reshape(*x.shape[:-1], n)
