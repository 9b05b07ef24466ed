"""Attention as eager runs it: a mask the tracer made, where eager passes none, is taken out of the graph.

While torch.export traces, transformers (and other libraries that ask `torch.compiler.is_compiling()`) build an
explicit attention mask that eager never makes: all true for a bidirectional model without padding, the lower
triangle for a causal one, expanded to the batch with stride 0. Eager hands scaled-dot-product attention no mask
(with `is_causal=True` for the causal one). The two compute the same numbers, but not with the same kernel: on a
GPU the memory-efficient kernel refuses a mask expanded along its last dimension, so the traced step took the math
path, which holds the attention probabilities for the backward (twice eager's memory on BERT) and draws its dropout
apart from the attention (other random numbers than eager's).

A mask is rewritten only where it is a constant of the step: computed from shapes and literals alone (no input,
parameter or buffer, nothing random), so evaluating it once at the capture gives its value at every step. All
true becomes no mask; the causal lower triangle becomes `is_causal=True`; a float mask of zeros becomes no mask.
Every other mask is kept as given, and the note says why.
"""

from __future__ import annotations

import torch
import torch.fx as fx

_ATTENTION = torch.ops.aten.scaled_dot_product_attention.default

# A constant mask is evaluated once on the CPU to read its values; beyond this many elements it is kept unread
MOST_MASK_ELEMENTS_READ = 1 << 27

_MASK, _IS_CAUSAL = 3, 5  # positions in aten.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
#                          is_causal, *, scale, enable_gqa)


def as_eager_runs_it(module: fx.GraphModule) -> list[tuple[str, str]]:
    """Rewrites, in place, every attention of `module` (and of the graph modules inside it, such as autocast
    regions) whose mask is a constant eager would not pass; returns, per attention with a mask, the module path
    it was traced in (the exported wrapper's: 'model.encoder...') and what became of its mask."""
    notes: list[tuple[str, str]] = []
    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        changed = False
        for node in list(graph_module.graph.find_nodes(op="call_function", target=_ATTENTION)):
            mask = _argument(node, _MASK, "attn_mask", None)
            if not isinstance(mask, fx.Node):
                continue
            note, rewritten = _rewrite(node, mask)
            notes.append((_module_path(node), note))
            if rewritten:
                _erase_unused(mask)
                changed = True
        if changed:
            graph_module.recompile()
    return notes


def _erase_unused(mask: fx.Node) -> None:
    """The mask and what computed it, where nothing else reads them any more (other layers may share the mask).
    Only these: they are constants, never random, so no draw the step makes is removed with them (the graph's
    eliminate_dead_code would also drop a random operation whose result is unused, and shift every draw after it)."""
    stack, erased = [mask], set()
    while stack:
        node = stack.pop()
        if node not in erased and node.op == "call_function" and not node.users:
            inputs = node.all_input_nodes
            node.graph.erase_node(node)
            erased.add(node)
            stack.extend(inputs)


def _argument(node: fx.Node, position: int, name: str, default):
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _with_arguments(node: fx.Node, mask, is_causal: bool) -> None:
    args = list(node.args)
    kwargs = dict(node.kwargs)
    for position, name, value in ((_MASK, "attn_mask", mask), (_IS_CAUSAL, "is_causal", is_causal)):
        if len(args) > position:
            args[position] = value
        else:
            kwargs[name] = value
    node.args, node.kwargs = tuple(args), kwargs


def _rewrite(node: fx.Node, mask: fx.Node) -> tuple[str, bool]:
    if _argument(node, _IS_CAUSAL, "is_causal", False):
        return "kept: a mask together with is_causal", False
    value, why_not = constant_value(mask)
    if value is None:
        return f"mask kept as given: {why_not}", False
    query, key = (_argument(node, i, "", None) for i in (0, 1))
    rows = query.meta["val"].shape[-2] if "val" in query.meta else value.shape[-2]
    columns = key.meta["val"].shape[-2] if "val" in key.meta else value.shape[-1]
    if value.dtype == torch.bool:
        if bool(value.all()):
            _with_arguments(node, None, False)
            return "the traced mask is all true: no mask, as eager passes", True
        if _is_causal_triangle(value, rows, columns):
            _with_arguments(node, None, True)
            return "the traced mask is the causal triangle: is_causal=True, as eager passes", True
        return "mask kept as given: a constant that is neither all true nor the causal triangle", False
    if value.is_floating_point() and bool((value == 0).all()):
        _with_arguments(node, None, False)
        return "the traced mask adds zero everywhere: no mask, as eager passes", True
    return "mask kept as given: a constant float mask that masks something", False


def _is_causal_triangle(value: torch.Tensor, rows: int, columns: int) -> bool:
    """Whether `value` is the lower triangle is_causal stands for (top left aligned), broadcast to its shape."""
    if value.dim() < 2 or value.shape[-2:] != (rows, columns):
        return False
    return bool((value == torch.ones(rows, columns, dtype=torch.bool).tril()).all())


def _is_random(target) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def constant_value(node: fx.Node) -> tuple[torch.Tensor | None, str]:
    """The value `node` takes at every step, evaluated on the CPU, where it is computed from shapes and literals
    alone; else None and why not."""
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor) and value.numel() > MOST_MASK_ELEMENTS_READ:
        return None, f"{value.numel():,} elements, more than the capture reads to check it"
    needed: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder":
            return None, f"it depends on the step's {_input_name(current.name)} (eager reads its values at run time)"
        if current.op != "call_function":
            return None, f"it depends on {current.op} {current.target} of the model"
        if _is_random(current.target):
            return None, "it is drawn at random"
        needed.append(current)
        stack.extend(current.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    values: dict[fx.Node, object] = {}
    cpu = torch.device("cpu")

    def on_cpu(argument):
        return cpu if isinstance(argument, torch.device) else argument

    try:
        for current in sorted(needed, key=order.__getitem__):
            args, kwargs = fx.node.map_arg((current.args, current.kwargs), values.__getitem__)
            args = torch.utils._pytree.tree_map(on_cpu, args)
            kwargs = {k: cpu if k == "device" and v is not None else on_cpu(v) for k, v in kwargs.items()}
            values[current] = current.target(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - a mask the capture cannot evaluate is kept, with the reason
        return None, f"it could not be evaluated at the capture ({type(error).__name__}: {error})"
    result = values[node]
    if not isinstance(result, torch.Tensor):
        return None, "it is not a tensor"
    return result, ""


def _input_name(placeholder: str) -> str:
    """The exported program's name of a user input, as the user passed it ('kwargs_attention_mask', 'args_1')."""
    if placeholder.startswith("kwargs_"):
        return f"input {placeholder.removeprefix('kwargs_')!r}"
    if placeholder.startswith("args_") and placeholder.removeprefix("args_").isdigit():
        return f"positional input {placeholder.removeprefix('args_')}"
    return f"input {placeholder!r}"


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else ""
