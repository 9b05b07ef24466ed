"""What the replay cannot see by running the captured graph: the model's Python state changed after the capture
(planned again), Python effects of forward (refused at the capture), and uses of autograd other than
loss.backward() (refused at the call). Each accepted step is compared bit for bit with plain PyTorch."""

from __future__ import annotations

import copy
import functools
import random

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import executor  # noqa: E402
from executor.errors import CaptureError, ProfileMismatch, ReplayError  # noqa: E402
from planner.errors import MososError  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.0)
        self.b = nn.Linear(32, 4)
        self.scale = 1.0  # a plain attribute forward reads: a curriculum, a temperature

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(x * self.scale))))


def data(seed: int, batch: int = 16):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 8, generator=generator), torch.randint(0, 4, (batch,), generator=generator)


def planned_pair(**options):
    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model)
    x, y = data(0)
    messages: list[str] = []
    planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=None, strategy="keep-all",
                                cache=False, timed_steps=0, progress=messages.append, **options)
    return model, plain, planned, messages


def step_equal(model, plain, planned, seed: int) -> bool:
    x, y = data(seed)
    for parameter in list(model.parameters()) + list(plain.parameters()):
        parameter.grad = None
    torch.manual_seed(seed)
    loss = planned(x, y)
    loss.backward()
    torch.manual_seed(seed)
    plain_loss = F.cross_entropy(plain(x), y)
    plain_loss.backward()
    return torch.equal(loss, plain_loss) and all(
        (p.grad is None and q.grad is None) or (p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad))
        for p, q in zip(model.parameters(), plain.parameters()))


@pytest.mark.parametrize("change, said", [
    (lambda m: setattr(m, "scale", 0.5), "attribute 'scale' 1.0 -> 0.5"),
    (lambda m: setattr(m.drop, "p", 0.3), "module drop: attribute 'p' 0.0 -> 0.3"),
    (lambda m: setattr(m, "drop", nn.Identity()), "module drop is now a Identity"),
    (lambda m: m.a.register_forward_hook(lambda module, args, output: output * 0.5), "module a: its hooks changed"),
    (lambda m: m.a.requires_grad_(False), "trainable"),
    (lambda m: m.drop.eval(), "module drop is now in eval mode"),
])
def test_a_model_changed_after_its_capture_is_planned_again_and_stays_plain_pytorchs(change, said):
    model, plain, planned, messages = planned_pair()
    assert step_equal(model, plain, planned, 1)
    change(model)
    change(plain)
    assert step_equal(model, plain, planned, 2)
    replanned = [m for m in messages if m.startswith("the model changed since its step was captured")]
    assert len(replanned) == 1 and said in replanned[0], messages
    assert step_equal(model, plain, planned, 3)  # the new plan is kept: no second re-plan
    assert len([m for m in messages if m.startswith("the model changed")]) == 1


def test_a_python_number_among_the_targets_that_changes_is_said_to_be_the_reason_for_a_new_plan():
    """mixup's weight as a float among the targets planned every step under "new input signature float32[64,16]",
    the shapes it had before: the message now names the value that changed and how to keep one plan."""
    torch.manual_seed(0)
    model = Net()
    x, y = data(0)
    messages: list[str] = []

    def mixed(output, targets):
        labels, weight = targets
        return weight * F.cross_entropy(output, labels)

    planned = executor.optimize(model, (x,), mixed, targets=(y, 0.5), budget=None, strategy="keep-all",
                                cache=False, timed_steps=0, progress=messages.append)
    planned(x, targets=(y, 0.5)).backward()
    planned(x, targets=(y, 0.8)).backward()
    said = [m for m in messages if "planning it once" in m]
    assert len(said) == 1 and "an input that is not a tensor changed value" in said[0] and "0.5" in said[0], said
    assert "0.8" in said[0] and "better passed as a 0-d tensor" in said[0]


def test_without_new_signatures_a_changed_model_is_refused():
    model, plain, planned, _ = planned_pair(new_signatures=False)
    model.scale = 2.0
    with pytest.raises(ProfileMismatch, match=r"the model changed since its step was captured \(module <root>: "
                                              r"attribute 'scale' 1.0 -> 2.0\)"):
        planned(*data(1))


class Counting(Net):
    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        return super().forward(x)


class PythonLayerDrop(Net):
    def forward(self, x):
        h = torch.tanh(self.a(x))
        if random.random() < 0.5:
            h = h * 2
        return self.b(h)


class NumpyNoise(Net):
    def forward(self, x):
        import numpy

        return super().forward(x) * float(numpy.random.rand() > 2)


@pytest.mark.parametrize("model_class, said", [
    # the change that recurs, not the first call's (none -> 1): the second capture is from the state the first left
    (Counting, r"its forward changes the model's Python state \(module <root>: attribute 'calls' 1 -> 2\)"),
    (PythonLayerDrop, "draws from Python's random module"),
    (NumpyNoise, "draws from NumPy's random generator"),
])
def test_python_effects_of_forward_are_refused_at_the_capture(model_class, said):
    numpy = pytest.importorskip("numpy")
    model = model_class()
    attributes = {name: set(vars(module)) for name, module in model.named_modules()}
    state, numpy_state = random.getstate(), numpy.random.get_state()
    with pytest.raises(CaptureError, match=said):
        executor.optimize(model, (data(0)[0],), F.cross_entropy, targets=data(0)[1], budget=None,
                          strategy="keep-all", cache=False, progress=False)
    # The refusal leaves everything as it was: no attribute added, neither generator moved.
    assert random.getstate() == state
    after = numpy.random.get_state()
    assert after[0] == numpy_state[0] and after[2:] == numpy_state[2:] and (after[1] == numpy_state[1]).all()
    assert {name: set(vars(module)) for name, module in model.named_modules()} == attributes


class SetUpOnce(Net):
    """What transformers does at a model's first forward: a field of its configuration set from the call, and a
    forward hook (its output recorder) registered once, behind an attribute that says so."""

    def forward(self, x):
        if not getattr(self, "_recorder_ready", False):
            self.a.register_forward_hook(lambda module, args, output: None)
            self._recorder_ready = True
            self.problem_type = "single_label_classification"
        return super().forward(x)


class ResetEveryCall(Net):
    """Funnel's attention structure: an attribute None until the first forward, which sets it to 1 and doubles it
    as it pools, so that every call leaves it 2. torch.export puts such an attribute back after tracing."""

    def __init__(self):
        super().__init__()
        self.pooling_mult = None

    def forward(self, x):
        self.pooling_mult = 1
        h = torch.tanh(self.a(x))
        self.pooling_mult *= 2
        return self.b(h)


class LazyBuffer(Net):
    """A cache made at the first forward (rotary tables, masks), registered as a buffer there."""

    def forward(self, x):
        if not hasattr(self, "table"):
            self.register_buffer("table", torch.full((8,), 0.5), persistent=False)
        return super().forward(x * self.table)


class BufferReplaced(Net):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls = self.calls + 1  # a new tensor every call, not an update in place
        return super().forward(x)


class HookEveryCall(Net):
    def forward(self, x):
        self.a.register_forward_hook(lambda module, args, output: None)
        return super().forward(x)


def _keep_all_beside_plain(model):
    """(an eager copy made before planning, the planned module) for `model`, planned keep-all on data(0)."""
    plain = copy.deepcopy(model)
    x, y = data(0)
    planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=None, strategy="keep-all",
                                cache=False, timed_steps=0, progress=False)
    return plain, planned


def _hook_counts(model):
    return {name: len(module._forward_hooks) for name, module in model.named_modules()}


def test_a_set_up_done_at_the_first_forward_only_is_kept_as_after_a_first_eager_call():
    """Refused before (transformers' classification heads with labels, Mixtral's router logits, wav2vec2: a fresh
    model could not be captured), and the refusal left the hooks registered while it took the attribute that said
    so away, so the next eager forward registered them twice."""
    torch.manual_seed(0)
    model = SetUpOnce()
    plain, planned = _keep_all_beside_plain(model)
    assert step_equal(model, plain, planned, seed=1) and step_equal(model, plain, planned, seed=2)
    assert _hook_counts(model) == _hook_counts(plain) and model.problem_type == plain.problem_type


def test_an_attribute_a_forward_sets_the_same_at_every_call_is_kept_as_after_a_first_eager_call():
    """Refused before (transformers' Funnel, fresh): torch.export put the attribute back to None, so the second
    capture saw None -> 2 again."""
    torch.manual_seed(0)
    model = ResetEveryCall()
    plain, planned = _keep_all_beside_plain(model)
    assert step_equal(model, plain, planned, seed=1) and step_equal(model, plain, planned, seed=2)
    assert model.pooling_mult == plain.pooling_mult == 2


def test_a_buffer_a_forward_registers_is_refused_and_taken_away_and_the_advice_works():
    """The capture's forward runs on fake tensors: the buffer it registered stayed on the model as a fake tensor
    (optimize() succeeded, an eval under no_grad returned a fake loss, saving the model failed)."""
    torch.manual_seed(0)
    model = LazyBuffer()
    x, y = data(0)
    with pytest.raises(CaptureError, match=r"its forward registers buffer 'table' of module <root>.*call the model "
                                           r"once before optimize\(\)"):
        executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=None, strategy="keep-all", cache=False,
                          progress=False)
    assert "table" not in dict(model.named_buffers())
    with torch.no_grad():
        model(x[:1])  # as the refusal says
    plain, planned = _keep_all_beside_plain(model)
    assert step_equal(model, plain, planned, seed=1)
    assert type(model.table) is torch.Tensor


def test_a_buffer_a_forward_replaces_at_every_call_is_refused_and_put_back():
    model = BufferReplaced()
    before = model.calls
    x, y = data(0)
    with pytest.raises(CaptureError, match=r"its forward replaces buffer 'calls' of module <root>.*in place"):
        executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=None, strategy="keep-all", cache=False,
                          progress=False)
    assert model.calls is before


def test_a_parameter_loaded_in_another_layout_is_planned_again():
    """A checkpoint holding a weight transposed (load_state_dict(assign=True)): the graph's matrix products were
    traced for the old strides, and the gradients came out 2.8e-9 from eager's, silently."""
    torch.manual_seed(0)
    model = Net()
    _, planned = _keep_all_beside_plain(model)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    state["b.weight"] = state["b.weight"].t().contiguous().t()
    model.load_state_dict(state, assign=True)
    plain = copy.deepcopy(model)
    assert model.b.weight.stride() == plain.b.weight.stride() == (1, 4)
    assert step_equal(model, plain, planned, seed=1)


def test_a_model_cast_to_another_type_is_planned_again_within_its_budget_or_refused_saying_why():
    """After model.to(torch.float64) the float32 plan ran on, its ledger 1.58x over the budget it was made for, and
    the inputs' types alone did not tell (the model may cast them itself)."""
    from planner.errors import BudgetError

    class CastsItsInputs(Net):
        def forward(self, x):
            return super().forward(x.to(self.a.weight.dtype))

    torch.manual_seed(0)
    model = CastsItsInputs()
    x, y = data(0)
    messages: list[str] = []
    planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=None, strategy="keep-all",
                                cache=False, timed_steps=0, progress=messages.append)
    model.double()
    plain = copy.deepcopy(model)
    assert step_equal(model, plain, planned, seed=1)
    assert any("a parameter's type changed (float32 -> float64)): planning it again" in m for m in messages)
    assert planned.peak_memory_bytes == planned.simulated_peak_bytes

    budget = executor.optimize(CastsItsInputs(), (x,), F.cross_entropy, targets=y, budget=None, memory_ratio=1.0,
                               cache=False, progress=False, time_limit_s=2, workers=1).schedule.budget_bytes
    torch.manual_seed(0)
    model = CastsItsInputs()
    planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=budget, cache=False,
                                timed_steps=0, progress=False, time_limit_s=2, workers=1)
    planned(x, y).backward()  # the replay's .grad: a view kept its float32 base under model.double()
    model.double()
    with pytest.raises(BudgetError, match=r"the model changed since its step was captured \(a parameter's type "
                                          r"changed \(float32 -> float64\)\), and planning it again failed"):
        planned(x, y)
    model.float()
    planned(x, y).backward()  # the float32 plan is kept
    assert planned.peak_memory_bytes <= budget


def test_inputs_the_fake_capture_accepts_but_the_step_does_not_are_said_in_the_users_terms():
    """int32 targets for a cross entropy: the capture on fake tensors took them, and the first real run raised from
    inside the generated code. The module keeps its plans."""
    torch.manual_seed(0)
    model = Net()
    plain, planned = _keep_all_beside_plain(model)
    x, y = data(0)
    with pytest.raises(CaptureError, match=r"fails on these inputs when it first runs: RuntimeError: expected target "
                                           r"dtype to be Long or Byte, but got Int\. Inputs float32\[16,8\], targets "
                                           r"int32\[16\]"):
        planned(x, y.int())
    assert step_equal(model, plain, planned, seed=1)


def test_a_forward_that_registers_a_hook_at_every_call_is_refused_and_its_hooks_are_taken_away():
    torch.manual_seed(0)
    model = HookEveryCall()
    before = _hook_counts(model)
    x, y = data(0)
    with pytest.raises(CaptureError, match=r"Python state \(module a: its hooks changed\) at every call"):
        executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=None, strategy="keep-all", cache=False,
                          progress=False)
    assert _hook_counts(model) == before


def _labelled_steps_equal(model, shape, classes, memory_ratio, seeds):
    """A transformers classifier planned with its own labels, a step per seed against an eager copy, each bitwise
    (asserted); the copy."""
    plain = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 128, shape, generator=generator), torch.randint(0, classes, shape[:1],
                                                                                   generator=generator)
    planned = executor.optimize(model, (), lambda output: output.loss, kwargs={"input_ids": ids, "labels": labels},
                                memory_ratio=memory_ratio, time_limit_s=5, workers=1, cache=False, progress=False)
    for seed in seeds:
        torch.manual_seed(seed)
        loss = planned(input_ids=ids, labels=labels)
        loss.backward()
        torch.manual_seed(seed)
        plain_loss = plain(input_ids=ids, labels=labels).loss
        plain_loss.backward()
        assert torch.equal(loss, plain_loss)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()))
    return plain


def test_a_transformers_classifier_trained_with_its_labels_is_captured_fresh():
    """transformers sets config.problem_type at the first forward with labels."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=3)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).train()
    plain = _labelled_steps_equal(model, (4, 16), 3, memory_ratio=0.8, seeds=(1,))
    assert model.config.problem_type == plain.config.problem_type


@pytest.mark.parametrize("memory_ratio", [1.0, 0.9])
def test_a_fresh_funnel_trains_as_plain_pytorch(memory_ratio):
    """transformers' Funnel sets an attribute at every call (refused before: torch.export put it back) and draws its
    positional dropout from constants alone, after the embeddings' dropout (the memory-aware order computed it
    first and the replay refused the plan; a backward node made of constants came before the loss)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.FunnelConfig(vocab_size=128, d_model=32, n_head=2, d_head=16, d_inner=64,
                                       block_sizes=[1, 1], num_decoder_layers=1, num_labels=4)
    torch.manual_seed(0)
    model = transformers.FunnelForSequenceClassification(config).train()
    _labelled_steps_equal(model, (2, 64), 4, memory_ratio=memory_ratio, seeds=(1, 2))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_other_uses_of_autograd_are_refused_and_leave_grad_alone():
    model, _, planned, _ = planned_pair()
    x, y = data(1)
    parameters = list(model.parameters())
    with pytest.raises(ReplayError, match="torch.autograd.grad on a planned step"):
        torch.autograd.grad(planned(x, y), parameters)
    assert all(p.grad is None for p in parameters)
    with pytest.raises(ReplayError, match="backward\\(inputs=...\\) on a planned step over its parameters"):
        planned(x, y).backward(inputs=[model.a.weight])
    with pytest.raises(ReplayError, match="create_graph=True"):
        planned(x, y).backward(create_graph=True)
    handle = model.b.weight.register_hook(lambda gradient: gradient * 0)
    with pytest.raises(ReplayError, match="parameter 'b.weight' has a gradient hook"):
        planned(x, y)
    handle.remove()


def test_post_accumulate_grad_hooks_still_run_as_in_eager():
    model, plain, planned, _ = planned_pair()
    seen, plain_seen = [], []
    model.b.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    plain.b.weight.register_post_accumulate_grad_hook(lambda p: plain_seen.append(p.grad.clone()))
    assert step_equal(model, plain, planned, 1)
    assert len(seen) == len(plain_seen) == 1 and torch.equal(seen[0], plain_seen[0])


def test_a_step_not_backed_up_gives_way_to_the_next_one():
    """The budget holds one step at a time: a later call frees an earlier step's saved tensors, and that step's
    backward is then refused; the later step is plain PyTorch's."""
    model, plain, planned, _ = planned_pair()
    x1, y1 = data(1)
    skipped = planned(x1, y1)  # a batch the loop skips, its loss still referenced
    assert step_equal(model, plain, planned, 2)
    with pytest.raises(ReplayError, match="comes after the planned module began a later step"):
        skipped.backward()
    # Two calls' losses summed: refused before the later step writes anything (autograd runs it first).
    grads = [p.grad.clone() for p in model.parameters()]
    first, second = planned(x1, y1), planned(*data(2))
    with pytest.raises(ReplayError, match="goes through an earlier call of this planned module.*plan the module that "
                                          "contains both uses. No gradient of this planned module was written"):
        (first + second).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    # The superseded loss, kept (for logging), does not stand in the way of the next steps.
    assert step_equal(model, plain, planned, 3)
    assert first.item() == first.item()


def test_a_memory_ratio_holds_a_small_last_batch_at_the_first_batchs_bytes():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 64), nn.Tanh()]
    for _ in range(6):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(64, 4))
    plain = copy.deepcopy(model)
    x, y = data(0, batch=2048)
    planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, memory_ratio=0.6, cache=False,
                                timed_steps=0, progress=False, time_limit_s=5, workers=1)
    first_budget = planned.schedule.budget_bytes
    x, y = data(1, batch=3)
    loss = planned(x, y)
    loss.backward()
    plain_loss = F.cross_entropy(plain(x), y)
    plain_loss.backward()
    assert torch.equal(loss, plain_loss)
    assert planned.schedule.budget_bytes >= first_budget and planned.peak_memory_bytes <= planned.schedule.budget_bytes


TEMPERATURE = {"value": 1.0}  # a global configuration object, read by forward: no key can see it


class Tempered(Net):
    def forward(self, x):
        return super().forward(x) / TEMPERATURE["value"]


def test_the_plan_cache_checks_a_hit_against_a_fresh_capture(tmp_path):
    def run(label_smoothing: float) -> list[str]:
        torch.manual_seed(0)
        model = Tempered()
        plain = copy.deepcopy(model)
        x, y = data(0)
        loss_fn = functools.partial(F.cross_entropy, label_smoothing=label_smoothing)
        messages: list[str] = []
        planned = executor.optimize(model, (x,), loss_fn, targets=y, budget=None, strategy="keep-all",
                                    cache=tmp_path, timed_steps=0, progress=messages.append)
        loss = planned(x, y)
        assert torch.equal(loss, loss_fn(plain(x), y))
        return messages

    assert not any("no profile or solve" in m for m in run(0.0))
    assert any("no profile or solve" in m for m in run(0.0))
    assert not any("kept" in m and "no profile" in m for m in run(0.2))  # the partial's argument is in the key
    TEMPERATURE["value"] = 4.0
    try:
        messages = run(0.0)
    finally:
        TEMPERATURE["value"] = 1.0
    assert any("a fresh capture of the step differs from the kept one" in m for m in messages), messages
    assert not any("no profile or solve" in m for m in messages)


def test_a_deep_copy_trains_under_the_same_plan_on_its_own_weights():
    """EMA models and model soups copy the planned module: the copy is a module of its own, and both train as plain
    PyTorch does."""
    model, plain, planned, _ = planned_pair()
    copied = copy.deepcopy(planned)
    assert copied.model is not model and copied.schedule == planned.schedule
    assert all(p is not q and torch.equal(p, q) for p, q in zip(copied.model.parameters(), model.parameters()))
    plain_copy = copy.deepcopy(plain)
    assert step_equal(copied.model, plain_copy, copied, 1)
    assert all(p.grad is None for p in model.parameters())
    assert step_equal(model, plain, planned, 2)
    with torch.no_grad():
        assert torch.equal(copied(*data(3)), F.cross_entropy(plain_copy(data(3)[0]), data(3)[1]))


def test_a_pickled_planned_module_loads_and_trains_under_the_same_plan():
    """torch.save of the whole planned module failed ("Can't pickle local object 'optimize.<locals>.replan'"); it
    is saved as a deep copy is made, and the loaded module captures its step again at its first training call."""
    import io
    import pickle

    model, plain, planned, _ = planned_pair()
    assert step_equal(model, plain, planned, 1)
    buffer = io.BytesIO()
    torch.save(planned, buffer)
    buffer.seek(0)
    for loaded in (torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(planned))):
        assert loaded.schedule == planned.schedule and loaded.model is not model
        plain_copy = copy.deepcopy(plain)
        assert step_equal(loaded.model, plain_copy, loaded, 2)
    assert step_equal(model, plain, planned, 3)


@pytest.mark.parametrize("loss_fn", [
    lambda output, targets: F.cross_entropy(output, targets).detach(),
    lambda output, targets: (output.argmax(1) == targets).sum(),
    lambda output, targets: targets.float().mean(),
])
def test_a_loss_that_depends_on_no_parameter_is_refused_at_the_capture(loss_fn):
    x, y = data(0)
    with pytest.raises(CaptureError, match="depends on none of its trainable parameters"):
        executor.optimize(Net(), (x,), loss_fn, targets=y, budget=None, strategy="keep-all", cache=False,
                          progress=False)


@pytest.mark.parametrize("options, said", [
    ({"timed_steps": -1}, "timed_steps is a whole number of steps, at least 0, not -1"),
    ({"cache": 123}, "cache is True, False, None or a folder"),
    ({"kwargs": [1]}, "kwargs are the model's keyword inputs as a dict, not list"),
    ({"time_limit_s": -5}, "time limit must be a positive number of seconds, not -5"),
    ({"time_limit_s": 1e17}, r"time limit must be at most 86400 s \(a day\), not 1e\+17"),
    ({"strategy": "bogus"}, "unknown strategy 'bogus'"),
    ({"memory_ratio": 1.5}, r"memory ratio must be a number in \(0, 1\], not 1.5"),
])
def test_bad_optimize_arguments_are_clear_errors(options, said):
    x, y = data(0)
    with pytest.raises(MososError, match=said):
        executor.optimize(Net(), (x,), F.cross_entropy, targets=y, budget=None, progress=False, **options)


class Scaled(Net):
    def __init__(self, scale: float):
        super().__init__()
        self.table = torch.full((32,), scale)  # a tensor attribute, not a buffer: a constant of the graph


def test_a_cache_hit_takes_the_graphs_tensor_constants_from_this_run(tmp_path):
    """No key or hash sees a tensor constant's values (a tensor attribute, a loss's class weights): a hit must use
    this run's, not the kept copies."""

    class Tabled(Scaled):
        def forward(self, x):
            return self.b(torch.tanh(self.a(x)) * self.table)

    def run(scale: float, weight: float) -> list[str]:
        torch.manual_seed(0)
        model = Tabled(scale)
        plain = copy.deepcopy(model)
        x, y = data(0)
        loss_fn = functools.partial(F.cross_entropy, weight=torch.full((4,), weight))
        messages: list[str] = []
        planned = executor.optimize(model, (x,), loss_fn, targets=y, budget=None, strategy="keep-all",
                                    cache=tmp_path, timed_steps=0, progress=messages.append)
        assert torch.equal(planned(x, y), loss_fn(plain(x), y))
        return messages

    run(1.0, 1.0)
    assert any("no profile or solve" in m for m in run(3.0, 1.0))
    assert any("no profile or solve" in m for m in run(1.0, 5.0))


def test_a_data_parallel_wrapper_is_refused_with_the_order_that_works():
    x, y = data(0)
    with pytest.raises(MososError, match=r"plans the model itself, not a DataParallel around it: plan the model, "
                                         r"then wrap the planned module"):
        executor.optimize(nn.DataParallel(Net()), (x,), F.cross_entropy, targets=y, budget=None, progress=False)


def test_a_transformers_configuration_changed_after_the_capture_is_planned_again():
    """Mistral reads `config.sliding_window` at every forward: changed after optimize(), the replay kept the old
    mask (loss 4.86842 against eager's 4.86631); so did a switch of the attention implementation."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                                        max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config)
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))

    def loss_fn(output, labels):
        return F.cross_entropy(output.logits.flatten(0, 1), labels.flatten())

    messages: list[str] = []
    planned = executor.optimize(model, (), loss_fn, kwargs={"input_ids": ids}, targets=ids, budget=None,
                                strategy="keep-all", cache=False, progress=messages.append)
    for window in (8, 4):
        model.config.sliding_window = plain.config.sliding_window = window
        loss = planned(input_ids=ids, targets=ids)
        assert torch.equal(loss, loss_fn(plain(input_ids=ids), ids)), window
    assert any("attribute 'config.sliding_window' 8 -> 4" in message for message in messages), messages
