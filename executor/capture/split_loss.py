"""A language model's loss that never holds its logits whole: the LM head and cross-entropy over row chunks.

Eager computes `cross_entropy(linear(hidden, weight).view(-1, vocab), labels)` whole: the logits, their log-softmax
(saved for the backward) and, in the backward, their gradient are each rows x vocab. Over a real vocabulary
(GPT-2's 50,257 classes) these set the floor of any plan: one node no schedule can split.

The split loss takes the same inputs and computes, chunk by chunk of rows, the logits, their log-sum-exp, the loss,
and the loss's gradient with respect to the chunk's logits; from that gradient it makes at once the hidden
states' gradient (rows of it) and the weight's (a sum over chunks), and lets the chunk's logits go. What it saves
for the backward is those two gradients (the hidden states' size and the weight's), which the backward scales by the
loss's incoming gradient. The loss is the mean or the sum over the rows (transformers' Trainer asks for the sum,
then divides by the tokens of the whole accumulated batch). The same three matrix products as eager's (logits, hidden gradient, weight gradient), so
no arithmetic is added; a chunk's logits are at most the weight's size.

The results agree with eager's to rounding, not bitwise (the weight's gradient is summed over chunks, and
log-sum-exp is not log-softmax's kernel): the rewrite is made only where the caller asks for it
(`optimize(..., split_loss=True)`), and never under autocast, where eager's logits are half precision and this
kernel's are not.

The pattern rewritten, in the exported graph (before the backward is traced; transformers' causal LM loss):
`linear(x, W)` with no bias, optionally `to(float32)` of a float32 result, `view(-1, vocab)`, then
`cross_entropy_loss(logits, target, weight=None, reduction='mean' or 'sum', ignore_index, label_smoothing=0)`, each
read by the next alone.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

ATEN = torch.ops.aten


@torch.library.custom_op("mosos::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                         rows_per_chunk: int, mean: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy of `hidden @ weight.T` against `target`, its mean or its sum over the rows (rows whose target
    is `ignore_index` count for nothing), with its gradients with respect to `hidden` and `weight`."""
    rows = hidden.shape[0]
    valid = target != ignore_index
    count = valid.sum().to(hidden.dtype) if mean else hidden.new_ones(())
    loss_sum = hidden.new_zeros(())
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros_like(weight)
    step = max(1, int(rows_per_chunk))
    for start in range(0, rows, step):
        part = slice(start, min(rows, start + step))
        chunk, chunk_target, chunk_valid = hidden[part], target[part], valid[part]
        logits = torch.mm(chunk, weight.t())
        taken = torch.where(chunk_valid, chunk_target, 0).unsqueeze(1)
        picked = logits.gather(1, taken).squeeze(1)
        # log-sum-exp and softmax in the chunk's own storage: no second buffer of its size
        row_max = logits.amax(dim=1, keepdim=True)
        logits.sub_(row_max).exp_()
        sum_exp = logits.sum(dim=1)
        log_sum_exp = sum_exp.log() + row_max.squeeze(1)
        loss_sum += torch.where(chunk_valid, log_sum_exp - picked, 0).sum()
        # the loss sum's gradient with respect to the logits: softmax less one at the target, on counted rows
        logits.div_(sum_exp.unsqueeze(1))
        counted = chunk_valid.to(logits.dtype).unsqueeze(1)
        logits.scatter_add_(1, taken, -counted)
        logits.mul_(counted)
        torch.mm(logits, weight, out=grad_hidden[part])
        grad_weight.addmm_(logits.t(), chunk)
        del logits
    grad_hidden.div_(count)
    grad_weight.div_(count)
    return loss_sum / count, grad_hidden, grad_weight


@linear_cross_entropy.register_fake
def _(hidden, weight, target, ignore_index, rows_per_chunk, mean):
    return hidden.new_empty(()), torch.empty_like(hidden), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    _, grad_hidden, grad_weight = output
    ctx.save_for_backward(grad_hidden, grad_weight)
    ctx.mark_non_differentiable(grad_hidden, grad_weight)


def _backward(ctx, grad_loss, _grad_hidden, _grad_weight):
    grad_hidden, grad_weight = ctx.saved_tensors
    return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None, None


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)

LINEAR_CROSS_ENTROPY = torch.ops.mosos.linear_cross_entropy.default


def rows_per_chunk(rows: int, hidden_size: int) -> int:
    """As many rows as the hidden size (as Liger's fused loss sizes its chunks): a chunk's logits, the kernel's one
    buffer beyond its results, are then at most the weight gradient's size, the largest result, which is what the
    profile allows any kernel's unseen scratch (executor.measure.measuring.scratch_allowance_bytes)."""
    return max(1, min(rows, hidden_size))


def _value(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _only_reader(node: fx.Node, skip=(ATEN._assert_tensor_metadata.default,)) -> fx.Node | None:
    readers = [u for u in node.users if u.target not in skip]
    return readers[0] if len(readers) == 1 else None


def _argument(node: fx.Node, position: int, name: str, default):
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _match(loss: fx.Node) -> tuple[dict | None, str]:
    """The chain ending at a cross_entropy_loss node, or None and why it is not the pattern."""
    logits_2d, target = loss.args[0], loss.args[1]
    if _argument(loss, 2, "weight", None) is not None:
        return None, "class weights"
    if _argument(loss, 3, "reduction", 1) not in (1, 2):
        return None, "a reduction other than the mean or the sum"
    if _argument(loss, 5, "label_smoothing", 0.0) != 0.0:
        return None, "label smoothing"
    if not isinstance(logits_2d, fx.Node) or logits_2d.target not in (ATEN.view.default, ATEN.reshape.default):
        return None, "its logits are not a view of a linear layer's output"
    chain = [logits_2d]
    source = logits_2d.args[0]
    if isinstance(source, fx.Node) and source.target in (ATEN.to.dtype, ATEN._to_copy.default):
        chain.append(source)
        source = source.args[0]
    if not isinstance(source, fx.Node) or source.target is not ATEN.linear.default or \
            _argument(source, 2, "bias", None) is not None:
        return None, "its logits are not a linear layer's output without bias"
    chain.append(source)
    # each value in the chain is read by the next alone (the linear's output by the cast or the view, ...)
    readers = [loss] + chain[:-1]
    for value, reader in zip(chain, readers):
        if _only_reader(value) is not reader:
            return None, "its logits are read elsewhere too"
    hidden, weight = source.args[0], source.args[1]
    values = [_value(n) for n in (hidden, weight, source, loss, *chain)]
    if any(v is None for v in values) or any(v.dtype != torch.float32 for v in values):
        return None, "not all of it is float32"
    if _value(target) is None or _value(target).dim() != 1:
        return None, "its target is not one class index per row"
    if _value(weight).dim() != 2 or _value(logits_2d).dim() != 2:
        return None, "its shapes are not (rows, classes)"
    return {"chain": chain, "hidden": hidden, "weight": weight, "target": target,
            "ignore_index": _argument(loss, 4, "ignore_index", -100),
            "mean": _argument(loss, 3, "reduction", 1) == 1}, ""


def split_losses(module: fx.GraphModule) -> list[str]:
    """Rewrites, in place, each LM-head cross-entropy of `module`'s top graph into the split loss; returns a note
    per cross-entropy found (rewritten, or why not)."""
    notes = []
    graph = module.graph
    for loss in list(graph.find_nodes(op="call_function", target=ATEN.cross_entropy_loss.default)):
        found, why = _match(loss)
        if found is None:
            notes.append(f"the loss at {loss.name} is computed whole: {why}")
            continue
        hidden, weight = found["hidden"], found["weight"]
        hidden_value, weight_value = _value(hidden), _value(weight)
        hidden_size = weight_value.shape[1]
        rows = hidden_value.numel() // hidden_size
        chunk = rows_per_chunk(rows, hidden_size)
        linear = found["chain"][-1]
        with graph.inserting_before(loss):
            flat = graph.call_function(ATEN.reshape.default, (hidden, [-1, hidden_size]))
            split = graph.call_function(LINEAR_CROSS_ENTROPY,
                                        (flat, weight, found["target"], int(found["ignore_index"]), chunk,
                                         found["mean"]))
            value = graph.call_function(operator.getitem, (split, 0))
        for new in (flat, split, value):
            for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
                if key in linear.meta:
                    new.meta[key] = linear.meta[key]
        value.meta["val"] = _value(loss)
        loss.replace_all_uses_with(value)
        graph.erase_node(loss)
        for node in found["chain"]:
            for user in [u for u in node.users if u.target is ATEN._assert_tensor_metadata.default]:
                graph.erase_node(user)
            if not node.users:
                graph.erase_node(node)
        notes.append(f"the loss at {loss.name} is split: {rows} rows in chunks of {chunk} over "
                     f"{weight_value.shape[0]} classes")
    if any("is split" in n for n in notes):
        graph.lint()
        module.recompile()
    return notes
