"""Mixed precision: the captured step computes what eager `torch.autocast` computes, bit for bit, or is refused.

The autocast state around a call (which devices, which dtype, whether casts are
cached) is part of what a plan is made for, like the input shapes. The capture
re-enters that state inside the exported module, so torch.export records the
region (a `wrap_with_autocast` higher-order op) and AOTAutograd traces its
forward with autocast's casts and its backward without autocast, as an eager
backward runs. The replay then runs the captured graph, casts included, with
the ambient autocast turned off (it would cast a second time).

One thing the trace does not do as eager does: eager autocast casts a float32
parameter to the lower precision once per region and reuses that cast (the
autocast cache), so the gradients of all its lower-precision uses are summed in
the lower precision and cast back once; the trace casts at every use and sums
the cast-back gradients in float32. `share_parameter_casts` rewrites the joint
graph to eager's form, and refuses a shape of graph it cannot rewrite exactly.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

from executor.errors import CaptureError

DEVICES = ("cpu", "cuda")
_TO_COPY = torch.ops.aten._to_copy.default
_ADD = torch.ops.aten.add.Tensor


def autocast_state() -> tuple:
    """The autocast regions in force here: ((device, dtype name, cache enabled), ...), () outside any."""
    state = []
    for device in DEVICES:
        if torch.is_autocast_enabled(device):
            dtype = str(torch.get_autocast_dtype(device)).removeprefix("torch.")
            state.append((device, dtype, bool(torch.is_autocast_cache_enabled())))
    return tuple(state)


def describe(state: tuple) -> str:
    if not state:
        return "no autocast"
    return ", ".join(f"autocast {device} {dtype}" + ("" if cached else " (cache off)") for device, dtype, cached in state)


@contextlib.contextmanager
def entered(state: tuple):
    """Enter the autocast regions `state` describes (inside the exported module, at capture)."""
    with contextlib.ExitStack() as stack:
        for device, dtype, cached in state:
            stack.enter_context(torch.autocast(device, dtype=getattr(torch, dtype), cache_enabled=cached))
        yield


@contextlib.contextmanager
def disabled():
    """Ambient autocast off: the captured graph carries its own casts, and the capture re-enters the state itself."""
    with contextlib.ExitStack() as stack:
        for device in DEVICES:
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _left_deep_sum(node: fx.Node, owned: set) -> list[fx.Node] | None:
    """The terms of `node` as an add chain ((a + b) + c) + ..., in order, each add used only by the next; None when
    it is not one."""
    terms = []
    while node.op == "call_function" and node.target is _ADD and len(node.args) == 2 and not node.kwargs:
        left, right = node.args
        if not isinstance(right, fx.Node) or not isinstance(left, fx.Node):
            return None
        owned.add(node)
        terms.append(right)
        if left.target is _ADD and len(left.users) != 1:
            return None
        node = left
    terms.append(node)
    return terms[::-1]


def share_parameter_casts(gm: fx.GraphModule, parameters: dict[fx.Node, str], gradients: dict[str, fx.Node],
                          backward: set, model_name: str) -> dict[str, fx.Node]:
    """Give each parameter one cast per lower dtype, as eager's autocast cache does, and sum its gradients the way
    eager's autograd then does. Returns the (possibly new) gradient node of each rewritten parameter."""
    graph = gm.graph
    position = {node: i for i, node in enumerate(graph.nodes)}
    rewritten: dict[str, fx.Node] = {}
    for placeholder, name in parameters.items():
        by_dtype: dict[torch.dtype, list[fx.Node]] = {}
        for user in placeholder.users:
            if (user.target is _TO_COPY and user not in backward and user.args == (placeholder,)
                    and set(user.kwargs) == {"dtype"} and user.kwargs["dtype"] in (torch.bfloat16, torch.float16)):
                by_dtype.setdefault(user.kwargs["dtype"], []).append(user)
        for dtype, casts in by_dtype.items():
            if len(casts) < 2:
                continue
            casts.sort(key=position.get)
            gradient = gradients.get(name)
            if gradient is not None:
                gradient = _eager_gradient(graph, placeholder, name, casts, gradient, backward, model_name)
                rewritten[name] = gradient
                gradients[name] = gradient
            for cast in casts[1:]:
                cast.replace_all_uses_with(casts[0])
                graph.erase_node(cast)
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten


def _eager_gradient(graph: fx.Graph, placeholder: fx.Node, name: str, casts: list[fx.Node], gradient: fx.Node,
                    backward: set, model_name: str) -> fx.Node:
    """The traced gradient sums, in float32, one cast-back per use; eager sums the uses' lower-precision gradients
    (in the order they arrive, the order of the traced sum) and casts back once, where the last of them arrived."""
    refuse = (f"cannot reproduce eager autocast for {model_name}: parameter {name!r} is cast to lower precision "
              f"{len(casts)} times and its gradient is not a plain sum of their cast-backs")
    seq = {cast.meta.get("seq_nr") for cast in casts}
    owned: set = set()
    terms = _left_deep_sum(gradient, owned)
    if terms is None:
        raise CaptureError(refuse)
    cast_back = [t for t in terms if t.target is _TO_COPY and t in backward and t.meta.get("seq_nr") in seq
                 and isinstance(t.args[0], fx.Node) and len(t.users) == 1]
    if len(seq) != len(casts) or len({t.meta.get("seq_nr") for t in cast_back}) != len(cast_back):
        raise CaptureError(refuse)
    # a cast whose uses give no gradient (peft's DoRA normalises by a detached norm of the factors' product) adds
    # no term: no backward node differentiates it
    silent = seq - {t.meta.get("seq_nr") for t in cast_back}
    if any(node.meta.get("seq_nr") in silent for node in backward):
        raise CaptureError(refuse)
    if len(cast_back) < 2:  # one cast-back (or none): eager's sum in lower precision is the traced gradient
        return gradient
    kwargs = dict(cast_back[0].kwargs)
    if any(dict(t.kwargs) != kwargs for t in cast_back):
        raise CaptureError(refuse)
    last = max(terms.index(t) for t in cast_back)
    with graph.inserting_before(gradient.next):  # in order, after every term they read
        lower = cast_back[0].args[0]
        for term in cast_back[1:]:
            lower = graph.call_function(_ADD, (lower, term.args[0]))
            _tag(lower, term)
        once = graph.call_function(_TO_COPY, (lower,), kwargs)
        _tag(once, cast_back[-1])
        eager_terms = [t for i, t in enumerate(terms) if t not in cast_back or i == last]
        eager_terms = [once if t in cast_back else t for t in eager_terms]
        total = eager_terms[0]
        for term in eager_terms[1:]:
            total = graph.call_function(_ADD, (total, term))
            _tag(total, gradient)
    gradient.replace_all_uses_with(total)
    for node in sorted(owned | set(cast_back), key=position_in(graph), reverse=True):
        if not node.users:
            graph.erase_node(node)
    return total


def position_in(graph: fx.Graph):
    order = {node: i for i, node in enumerate(graph.nodes)}
    return order.get


def _tag(node: fx.Node, like: fx.Node) -> None:
    """Metadata of the node it stands in for (the backward tag, the module, the source line, the autograd sequence)
    and its fake value, which the planner sizes it by."""
    for key in ("partitioner_tag", "seq_nr", "nn_module_stack", "fwd_nn_module_stack", "stack_trace"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    from torch.utils._pytree import tree_flatten

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    mode = next(v.fake_mode for v in tree_flatten((args, kwargs, like.meta.get("val")))[0] if hasattr(v, "fake_mode"))
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)




_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default
_NATIVE_DROPOUT_BACKWARD = torch.ops.aten.native_dropout_backward.default
_HALF = (torch.bfloat16, torch.float16)


def eager_half_dropout(gm: fx.GraphModule) -> int:
    """Dropout on a bf16/fp16 tensor as eager PyTorch runs it on the CPU (`_dropout_impl`): the mask drawn in the
    tensor's dtype, divided by 1 - p in that dtype, then multiplied in; its backward multiplies by the same scaled
    mask. The traced `native_dropout` scales by 1 / (1 - p) in float32, which rounds differently in half precision
    (in float32 and float64 the two agree bit for bit, and are left alone). Returns how many were rewritten."""
    graph = gm.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.target is not _NATIVE_DROPOUT:
            continue
        source, p, train = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
        value = source.meta.get("val")
        if not train or value is None or value.dtype not in _HALF or value.device.type != "cpu" or not 0 < p < 1:
            continue
        items = {user.args[1]: user for user in node.users if user.target is operator.getitem}
        if set(items) - {0, 1} or len(items) != len(node.users):
            raise CaptureError(f"dropout node {node.name} is used in a way the executor cannot rewrite")
        backward_users = list(items[1].users) if 1 in items else []
        if any(u.target is not _NATIVE_DROPOUT_BACKWARD for u in backward_users):
            raise CaptureError(f"the mask of dropout node {node.name} is read by something other than its backward")
        order = _memory_order(value)
        if order is None:
            raise CaptureError(f"dropout node {node.name} draws its mask over a {tuple(value.shape)} tensor of "
                               f"strides {value.stride()}, whose eager draw order the executor does not reproduce")
        with graph.inserting_before(node):
            noise = _drawn_in_memory_order(graph, node, source, 1 - p, order)
            scaled = graph.call_function(torch.ops.aten.div.Scalar, (noise, 1 - p))
            _tag(scaled, node)
            output = graph.call_function(torch.ops.aten.mul.Tensor, (source, scaled))
            _tag(output, node)
        for backward in backward_users:
            with graph.inserting_before(backward):
                gradient = graph.call_function(torch.ops.aten.mul.Tensor, (backward.args[0], scaled))
                _tag(gradient, backward)
            backward.replace_all_uses_with(gradient)
            graph.erase_node(backward)
        if 0 in items:
            items[0].replace_all_uses_with(output)
            graph.erase_node(items[0])
        if 1 in items:
            graph.erase_node(items[1])
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten


def _memory_order(value: torch.Tensor) -> list[int] | None:
    """The dimensions from outermost to innermost in memory, where the tensor is dense (its permutation so ordered
    is contiguous); None where it is not."""
    order = sorted(range(value.dim()), key=lambda d: (-value.stride(d), -value.shape[d]))
    return order if value.permute(order).is_contiguous() else None


def _drawn_in_memory_order(graph: fx.Graph, like: fx.Node, source: fx.Node, keep: float, order: list[int]) -> fx.Node:
    """Eager's mask is `empty_like(input).bernoulli_(keep)`: laid out as the input, its numbers drawn in memory
    order. `bernoulli.p` draws into a contiguous tensor, so over a transposed input (nn.TransformerEncoderLayer's
    first dropout, on attention's batch-first output) it drew another mask: drawn here over the input permuted to
    memory order, and permuted back."""
    if order == list(range(len(order))):
        noise = graph.call_function(torch.ops.aten.bernoulli.p, (source, keep))
        _tag(noise, like)
        return noise
    permuted = graph.call_function(torch.ops.aten.permute.default, (source, order))
    noise = graph.call_function(torch.ops.aten.bernoulli.p, (permuted, keep))
    back = graph.call_function(torch.ops.aten.permute.default, (noise, [order.index(d) for d in range(len(order))]))
    for node in (permuted, noise, back):
        _tag(node, like)
    return back


@contextlib.contextmanager
def eager_mask_branch():
    """transformers builds an explicit causal mask when it sees torch.export (so that an exported graph serves every
    sequence length) and leaves it to attention's `is_causal` in eager runs. A capture here serves one input
    signature, so it takes eager's branch: without an attention mask that branch reads shapes only. (With a mask,
    transformers still keeps the capture free of value-dependent branches.) Under autocast the two branches round
    differently, so the capture must follow eager's."""
    import sys

    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "is_torchdynamo_exporting", None)
    if original is None:
        yield
        return
    masking.is_torchdynamo_exporting = lambda: False
    try:
        yield
    finally:
        masking.is_torchdynamo_exporting = original


def refuse_value_dependent_masks(kwargs: dict, state: tuple) -> None:
    """Under autocast, an attention mask of all ones is one the capture applies and eager transformers drops (it reads
    the mask's values); the two round differently in half precision. Refused rather than run differently."""
    import sys

    if not state or "transformers.masking_utils" not in sys.modules:
        return
    mask = (kwargs or {}).get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.numel() and bool(mask.all()):
        raise CaptureError(
            "attention_mask is all ones: under autocast, eager transformers drops such a mask (and masks inside "
            "attention), which rounds differently from applying it as the captured step does; pass "
            "attention_mask=None for a batch without padding")


__all__ = ["autocast_state", "describe", "entered", "disabled", "share_parameter_casts", "eager_half_dropout",
           "eager_mask_branch", "refuse_value_dependent_masks"]
