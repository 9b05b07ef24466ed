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
    if len(cast_back) != len(casts) or len({t.meta.get("seq_nr") for t in cast_back}) != len(casts):
        raise CaptureError(refuse)
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
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with like.meta["val"].fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)


__all__ = ["autocast_state", "describe", "entered", "disabled", "share_parameter_casts"]
