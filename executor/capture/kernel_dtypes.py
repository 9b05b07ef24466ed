"""Result dtypes as the kernels make them, where torch's fake tensors say otherwise.

The capture sizes every value, and the arena lays out its slot, from the trace's
fake tensors. For batch norm over a half-precision input those are wrong: the
fake kernels give the saved statistics the input's dtype (bf16 under autocast),
where the CPU kernel keeps the weight's (float32), and the functional variant's
updated running statistics come out float32 where the kernel keeps theirs. A
profile would then count half the statistics' bytes, and a slot laid out in bf16
would cast them. So the reference run asks the kernel itself: the same operator
on tiny real tensors of the same dtypes on the same device (two samples, one
position), once per combination, and takes its results' dtypes.
"""

from __future__ import annotations

import torch

_ATEN = torch.ops.aten
BATCH_NORMS = frozenset(
    getattr(getattr(_ATEN, name), overload)
    for name, overloads in (("_native_batch_norm_legit_functional", ("default",)),
                            ("_native_batch_norm_legit", ("default", "no_stats")),
                            ("_native_batch_norm_legit_no_training", ("default",)),
                            ("native_batch_norm", ("default",)))
    for overload in overloads if hasattr(getattr(_ATEN, name, None), overload))

_ASKED: dict[tuple, tuple[torch.dtype | None, ...]] = {}


def kernel_result_dtypes(target, args: tuple, kwargs: dict) -> tuple[torch.dtype | None, ...] | None:
    """The dtypes of `target`'s results as its kernel makes them for arguments like `args` (fake or real tensors
    give the dtypes, the device and the channels); None for an operator the fake kernels describe correctly."""
    if target not in BATCH_NORMS:
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    key = (target, tuple((a.dtype, a.device.type, a.dim()) if isinstance(a, torch.Tensor) else a for a in args),
           tuple(sorted(kwargs.items())))
    if key not in _ASKED:
        probe_input = args[0]
        small = tuple(
            torch.ones((2, *a.shape[1:2], *[1] * (a.dim() - 2)), dtype=a.dtype, device=a.device) if a is probe_input
            else torch.ones(tuple(a.shape), dtype=a.dtype, device=a.device) if isinstance(a, torch.Tensor) else a
            for a in args)
        with torch.no_grad(), torch.autocast(tensors[0].device.type, enabled=False):
            results = target(*small, **kwargs)
        _ASKED[key] = tuple(r.dtype if isinstance(r, torch.Tensor) else None for r in results)
    return _ASKED[key]


def with_kernel_dtypes(target, args: tuple, kwargs: dict, value, mode):
    """`value` (the fake kernel's results) with each result's dtype the kernel's, as new fake tensors of the same
    shape and strides made under `mode`; as it was where they agree."""
    dtypes = kernel_result_dtypes(target, args, kwargs)
    if dtypes is None or not isinstance(value, (tuple, list)) or len(dtypes) != len(value):
        return value
    if all(not isinstance(v, torch.Tensor) or v.dtype == d for v, d in zip(value, dtypes)):
        return value
    with mode:
        corrected = [torch.empty_strided(v.shape, v.stride(), dtype=d, device=v.device)
                     if isinstance(v, torch.Tensor) and d is not None and v.dtype != d else v
                     for v, d in zip(value, dtypes)]
    return type(value)(corrected)
