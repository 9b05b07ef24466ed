"""The memory-time frontier: what a PyTorch user picks instead of mosos, against mosos, on the CPU.

    python benchmarks/frontier.py                           # GPT-2, BERT, ResNet-18-small: every configuration
    python benchmarks/frontier.py --models gpt2 --rounds 5 --configs eager,per-block,mosos-0.5
    python benchmarks/frontier.py --device cuda --precisions fp32,bf16 --jobs 4   # on a GPU: frontier_gpu.md

Every configuration runs in a process of its own (torch.compile shares compiled code between instances of a model
in one process, so budgets would leak), beside an eager copy of the same weights. Time: the median over `--rounds`
of the pair ratio (configuration step / eager step, the two run back to back, alternating which goes first), so that
the machine's drift between processes (20-40%) cancels. Peak: the rise of live tensor storage during one step, from
the allocator's records (`executor.measure.allocations.AllocationTrace`), gradients set to None before it as
`optimizer.zero_grad()` leaves them. mosos on the CPU plans recomputation only (host memory is the same RAM).

Families: eager; per-block checkpointing (transformers' `gradient_checkpointing_enable()` where the model has it,
`torch.utils.checkpoint` around each block otherwise); torch.compile, also with
`torch._functorch.config.activation_memory_budget`; mosos (eager replay) at fractions of the keep-all peak; mosos
with compiled planning nodes (`mosos-compiled-<ratio>`, `optimize(compile=True)`; 1.0 is the keep-all budget); the
planner's own per-block baseline replayed by mosos (`mosos-per-block`: the simulator's view of per-block
checkpointing, measured); and mosos at the smallest budget it names (`mosos-smallest`, `mosos-compiled-smallest`:
asked for 1 byte, then for each budget its BudgetError names, as a user who wants the least memory would); on the
language models (GPT-2, and `gpt2-vocab`: GPT-2 with its real 50,257 classes, which the default run leaves out), mosos
with the loss split (`mosos-split-<ratio>`, `mosos-split-smallest`: `optimize(split_loss=True)`). Compile
time: torch.compile's first step, and the planned step's kernels as the profiling compiled them. Writes
benchmarks/results/frontier.md and frontier_<model>.png, and prints, for each torch configuration, the fastest mosos
plan at equal or less measured memory.

Every row but eager's also reports how far its gradients are from the eager copy's after one step from the same
seed (`grad error`: the largest |difference| / the largest |gradient| over the parameters; a gradient that is
rounding alone against the model's largest), beside the eager copy's own distance from itself run twice (`eager
noise`, a GPU's nondeterminism). mosos and per-block checkpointing draw eager's random numbers in eager's order;
torch.compile draws its own (Inductor's generator), so for a model with dropout its distance is that of other
dropout masks, and rounding only for one without (ResNet-18-small).

On a GPU (`--device cuda`): larger workloads (GPT-2 and BERT at hidden 768, sequence 512; ResNet-18-small at batch
32768), so that a step is not a few kernel launches; float32 or bfloat16 autocast (`--precisions`); the peak is
`torch.cuda.max_memory_allocated` less the memory allocated before the step; each step is timed between two
`torch.cuda.synchronize()`; mosos plans offloading as well as recomputation. `--jobs` prepares that many
configurations at once (torch.compile's compiling), while mosos' profiling and solving and every configuration's
peaks and timed rounds take turns (a lock file), so that nothing timed shares the GPU, and none of them runs
while torch.compile compiles for another (its threads slowed a step's kernel launches).
Writes benchmarks/results/frontier_gpu.md and frontier_gpu_<model>_<precision>.json/.png. A run on a borrowed
machine can write its rows to a log (`--rows-log`) and nothing else; `--merge-rows LOG --merge-command "how it was
measured"` then folds them into the results files here, keeping the other rows.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.results_file import write_section  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "frontier.md"
MIB = 2**20
MODELS = ("gpt2", "bert", "resnet")  # the default run's; gpt2-vocab is run by name
LANGUAGE_MODELS = ("gpt2", "gpt2-vocab")  # a causal LM loss over an LM head: the split loss's configurations apply
PRECISIONS = ("fp32", "bf16")
_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception)\b")  # a traceback's last line: the exception and message
MOSOS_RATIOS = (1.0, 0.9, 0.8, 0.6, 0.5, 0.35, 0.3)
# compiled: denser where torch.compile's configurations sit (between 0.45 and 0.9 of keep-all)
MOSOS_COMPILED_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.35, 0.3)
COMPILE_BUDGETS = (0.8, 0.5, 0.2)
TORCH_FAMILIES = ("per-block", "torch.compile", "torch.compile budget")
MOSOS_FAMILIES = ("mosos", "mosos compiled", "mosos split loss")


def all_configs() -> list[str]:
    return (["eager", "per-block", "compile"] + [f"compile-budget-{b}" for b in COMPILE_BUDGETS]
            + ["mosos-per-block"] + [f"mosos-{r}" for r in MOSOS_RATIOS] + ["mosos-smallest"]
            + [f"mosos-compiled-{r}" for r in MOSOS_COMPILED_RATIOS] + ["mosos-compiled-smallest"]
            + [f"mosos-split-{r}" for r in MOSOS_RATIOS] + ["mosos-split-smallest"])


def family(config: str) -> str:
    if config == "eager":
        return "eager"
    if config == "per-block":
        return "per-block"
    if config == "compile":
        return "torch.compile"
    if config.startswith("compile-budget-"):
        return "torch.compile budget"
    if config == "mosos-per-block":
        return "mosos per-block plan"
    if config.startswith("mosos-compiled-"):
        return "mosos compiled"
    if config.startswith("mosos-split-"):
        return "mosos split loss"
    return "mosos"


def workload(model: str, device: str = "cpu"):
    """The issue's configurations on the CPU: 4 layers, hidden 256, sequence 256, batch 16 (float32); ResNet-18-small
    at batch 2048 (its activations well above its fixed memory, as for a model that does not fit). On a GPU: hidden
    768 at sequence 512, and ResNet-18-small at batch 32768, built on the CPU and moved there."""
    import torch

    from benchmarks import workloads

    gpu = device != "cpu"
    if model == "gpt2":
        work = workloads.gpt2_small(batch_size=16, sequence=512 if gpu else 256, hidden=768 if gpu else 256)
    elif model == "bert":
        work = workloads.bert_small(batch_size=16, sequence=512 if gpu else 256, hidden=768 if gpu else 256)
    elif model == "gpt2-vocab":
        work = workloads.gpt2_vocab()
    elif model == "resnet":
        built = workloads.resnet18_small(batch_size=32768 if gpu else 2048)
        work = {"model": built.model, "inputs": built.inputs, "kwargs": built.kwargs, "targets": built.targets,
                "loss_fn": built.loss_fn}
    else:
        raise SystemExit(f"unknown model {model!r}; known: {', '.join(MODELS + ('gpt2-vocab',))}")
    if gpu:
        from torch.utils._pytree import tree_map_only

        def moved(value):
            return tree_map_only(torch.Tensor, lambda tensor: tensor.to(device), value)

        work = dict(work, model=work["model"].to(device), inputs=moved(work["inputs"]),
                    kwargs=moved(work.get("kwargs") or {}), targets=moved(work.get("targets")))
    return work


def autocast_for(device: str, precision: str):
    """A fresh context for each step: bfloat16 autocast, or nothing for float32."""
    import torch

    if precision == "fp32":
        return contextlib.nullcontext
    if precision == "bf16":
        return lambda: torch.autocast(device, dtype=torch.bfloat16)
    raise SystemExit(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")


@contextlib.contextmanager
def _locked(variable: str, mode: int):
    path = os.environ.get(variable)
    if not path:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, mode)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def gpu_turn():
    """Exclusive use of the device while a configuration profiles (mosos) and is measured (the lock file that
    `--jobs` shares between its children), and a quiet CPU: no torch.compile compiling beside it (`compiling()`),
    whose threads slowed the launches of a step of a few hundred kernels (on an H200, an eager GPT-2 step timed at
    57 ms beside others' compiles against 44 alone). Nothing where there is no lock file."""
    with _locked("FRONTIER_GPU_LOCK", fcntl.LOCK_EX), _locked("FRONTIER_QUIET_LOCK", fcntl.LOCK_EX):
        yield


@contextlib.contextmanager
def compiling():
    """torch.compile's compiling, beside other configurations' compiling but never beside a `gpu_turn()`."""
    with _locked("FRONTIER_QUIET_LOCK", fcntl.LOCK_SH):
        yield


def gradient_error(params, reference_params) -> float:
    """Over every parameter, the largest |difference| over its largest |reference gradient|; a gradient that is
    rounding alone (below 1000 float32 ulps of the model's largest, a bias before a batch norm) is measured
    against the model's largest instead, as the tests do."""
    pairs = list(zip(params, reference_params))
    if any((p is None) != (r is None) for p, r in pairs):
        return float("inf")
    pairs = [(p.double(), r.double()) for p, r in pairs if p is not None]
    largest = max((r.abs().max().item() for _, r in pairs), default=0.0) or 1.0
    floor = 1000 * 1.1920929e-07 * largest
    return max(((p - r).abs().max().item() / max(r.abs().max().item(), floor) for p, r in pairs), default=0.0)


def _blocks(model) -> list[tuple[object, str, object]]:
    """(parent, attribute, module) for each layer of a repeated container (as the planner's per-block baseline)."""
    from torch import nn

    found = []
    for _, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            numbered = [(name, child) for name, child in module.named_children() if name.isdigit()]
            if len(numbered) >= 2 and not any(child is module for _, child in numbered):
                found.extend((module, name, child) for name, child in numbered)
    # the outermost containers only: a layer inside a checkpointed layer is recomputed with it anyway
    inside = {id(m) for _, _, block in found for m in list(block.modules())[1:]}
    return [(parent, name, block) for parent, name, block in found if id(block) not in inside]


def checkpoint_per_block(model) -> str:
    """transformers' own gradient checkpointing where the model has it, else torch.utils.checkpoint per block."""
    import torch
    from torch import nn

    if getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return "transformers gradient_checkpointing_enable()"

    class Checkpointed(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, *args, **kwargs):
            return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False, **kwargs)

    blocks = _blocks(model)
    if not blocks:
        raise SystemExit("no repeated blocks to checkpoint")
    for parent, name, block in blocks:
        setattr(parent, name, Checkpointed(block))
    return f"torch.utils.checkpoint around {len(blocks)} blocks"


def child(model_name: str, config: str, rounds: int, time_limit_s: float, threads: int, device: str = "cpu",
          precision: str = "fp32") -> dict:
    import torch

    from executor.measure.allocations import AllocationTrace

    torch.set_num_threads(threads)
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available here")
    cast = autocast_for(device, precision)
    work = workload(model_name, device)
    model = work["model"]
    eager = copy.deepcopy(model)
    params = list(model.parameters())  # shared with what each configuration wraps (checkpointing, compile, mosos)
    inputs, kwargs, targets, loss_fn = work["inputs"], work.get("kwargs") or {}, work.get("targets"), work["loss_fn"]

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def plain_step(module):
        def step():
            for p in module.parameters():
                p.grad = None
            with cast():
                output = module(*inputs, **kwargs)
                loss = loss_fn(output, targets) if targets is not None else loss_fn(output)
            loss.backward()
        return step

    row = {"model": model_name, "config": config, "family": family(config), "note": "", "simulated_ms": None,
           "keep_all_simulated_ms": None, "prepare_s": None, "device": device, "precision": precision,
           "device_name": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__}
    started = time.perf_counter()
    turn = contextlib.ExitStack()  # this configuration's exclusive use of the device, once taken, to the end
    holding = False
    if config == "eager":
        step = plain_step(model)
    elif config == "per-block":
        row["note"] = checkpoint_per_block(model)
        step = plain_step(model)
    elif config.startswith("compile"):
        if config.startswith("compile-budget-"):
            import torch._functorch.config as functorch_config

            functorch_config.activation_memory_budget = float(config.rsplit("-", 1)[1])
        model = torch.compile(model)
        step = plain_step(model)
        with compiling():
            began = time.perf_counter()
            step()  # compiles forward and backward
            sync()
            row["compile_s"] = time.perf_counter() - began
        step()
    elif config.startswith("mosos"):
        import executor

        turn.enter_context(gpu_turn())  # profiling times every node on the device: alone, as the timed rounds
        holding = True

        compiled = config.startswith("mosos-compiled-")
        split = config.startswith("mosos-split-")
        asked_mib: list[str] = []
        if config.endswith("-smallest"):
            with cast():
                planned, asked_mib = _smallest_plan(model, inputs, loss_fn, targets, kwargs, time_limit_s, compiled,
                                                    split)
        else:
            strategy, ratio = (("per-block", 1.0) if config == "mosos-per-block"
                               else ("mosos", float(config.split("-")[-1])))
            with cast():  # the plan is made for the step's autocast state, as a user's optimize() call is
                planned = executor.optimize(model, inputs, loss_fn, targets=targets, kwargs=kwargs,
                                            memory_ratio=ratio, strategy=strategy, time_limit_s=time_limit_s,
                                            progress=False, cache=False, compile=compiled, split_loss=split)

        def step():
            for p in planned.parameters():
                p.grad = None
            with cast():
                loss = planned(*inputs, targets=targets, **kwargs)
            loss.backward()

        step()
        # the timed first steps run node by node, and as many again after a re-plan (which runs beside the steps: its
        # plan is taken once it is ready)
        while planned.wait_for_replan() and planned.timing:
            step()
        report = planned.report()
        summary = planned.schedule.summary
        row["simulated_ms"] = summary.predicted_step_time_ms
        row["simulated_peak_mib"] = summary.peak_memory_bytes / MIB
        row["budget_mib"] = planned.schedule.budget_bytes / MIB if planned.schedule.budget_bytes else None
        row["note"] = f"{summary.strategy}, recompute {summary.recompute_time_ms:.0f} ms simulated"
        if asked_mib:
            row["note"] += f", budget {row['budget_mib']:.1f} MiB (asked {', '.join(asked_mib)})"
        if report is not None and any(earlier.replanned for earlier in report.history or []):
            row["note"] += ", re-planned on the timed steps"
        if summary.offloaded_bytes:
            row["note"] += f", offload {summary.offloaded_bytes / MIB:.0f} MiB, stall {summary.stall_time_ms:.1f} ms"
        if compiled:
            # the node kernels the profiling compiled, and the regions the replay compiled (executor.engine.regions)
            record, replayed = planned._prepared.profiled.compiled, planned.compiled_nodes
            row["compile_s"] = record.compile_seconds + replayed.compile_seconds
            row["note"] += f"; profiled: {record.describe()}; replayed: {replayed.describe()}"
        from planner.planning import plan

        row["keep_all_simulated_ms"] = plan(planned.profile, None, strategy="keep-all").summary.predicted_step_time_ms
    else:
        raise SystemExit(f"unknown configuration {config!r}; known: {', '.join(all_configs())}")
    sync()
    row["prepare_s"] = time.perf_counter() - started
    reference = plain_step(eager)

    def gradients(function, of):
        torch.manual_seed(0)
        function()
        sync()
        return [None if p.grad is None else p.grad.detach().clone() for p in of]

    def peak_bytes(function) -> int:
        if cuda:
            sync()
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            function()
            sync()
            return torch.cuda.max_memory_allocated(device) - before
        with AllocationTrace() as trace:
            function()
        return trace.peak_bytes

    if not holding:
        turn.enter_context(gpu_turn())
    with turn:
        reference()
        step()
        if config != "eager":
            expected = gradients(reference, eager.parameters())
            row["grad_error"] = gradient_error(gradients(step, params), expected)
            row["eager_noise"] = gradient_error(gradients(reference, eager.parameters()), expected)
        row["peak_mib"] = peak_bytes(step) / MIB
        ratios, eager_ms, config_ms = [], [], []
        for i in range(rounds):
            pair = [(reference, eager_ms), (step, config_ms)]
            for function, times in (pair if i % 2 == 0 else pair[::-1]):
                sync()
                began = time.perf_counter()
                function()
                sync()
                times.append((time.perf_counter() - began) * 1000)
            ratios.append(config_ms[-1] / eager_ms[-1])
    row.update(time_ratio=statistics.median(ratios), eager_ms=statistics.median(eager_ms),
               config_ms=statistics.median(config_ms))
    return row


def _smallest_plan(model, inputs, loss_fn, targets, kwargs, time_limit_s: float, compiled: bool,
                   split: bool = False):
    """The plan at the smallest budget mosos names: a budget no plan fits is a BudgetError naming the smallest one
    known to work (a lower bound first, from the capture; then what a measuring pass or the solver found), so ask
    with a budget far too small and then with each budget the error names, as a user who wants the least memory
    would. The plan, and the budgets asked for after the first (MiB)."""
    import executor
    from planner.errors import BudgetError

    budget_bytes, tried = 1, []
    for _ in range(6):
        try:
            planned = executor.optimize(model, inputs, loss_fn, targets=targets, kwargs=kwargs, budget=budget_bytes,
                                        time_limit_s=time_limit_s, progress=False, cache=False, compile=compiled,
                                        split_loss=split)
        except BudgetError as error:
            named = error.minimum_budget_bytes or 0
            # a budget the error names but that failed again: a little more
            budget_bytes = named if named > budget_bytes else int(budget_bytes * 1.02) + 1
            tried.append(f"{budget_bytes / MIB:.1f}")
            continue
        return planned, tried
    raise RuntimeError(f"no plan at the budgets the errors named: {', '.join(tried)} MiB")


def run_one(model: str, config: str, args, precision: str = "fp32", timeout_s: float | None = None) -> dict:
    command = [sys.executable, __file__, "--child", model, config, "--rounds", str(args.rounds),
               "--time-limit", str(args.time_limit), "--threads", str(args.threads), "--device", args.device,
               "--precisions", precision]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if args.jobs > 1:
        # children share the GPU's timed phases through a lock, and the machine's cores for Inductor's workers
        locks = Path(tempfile.gettempdir())
        env.update(FRONTIER_GPU_LOCK=str(locks / f"frontier-gpu-{os.getpid()}.lock"),
                   FRONTIER_QUIET_LOCK=str(locks / f"frontier-quiet-{os.getpid()}.lock"),
                   TORCHINDUCTOR_COMPILE_THREADS=str(max(1, (os.cpu_count() or 2) // args.jobs)))
    # Inductor's caches of its own, empty: every configuration compiles as on a user's first run (a warm cache
    # left by an earlier configuration of the same model made torch.compile's 23 s compile take 2.5 s)
    with tempfile.TemporaryDirectory(prefix="frontier-inductor-") as inductor_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache
        try:
            done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return failed_row(model, config, args.device, precision,
                              f"not finished within {timeout_s:.0f} s (--child-timeout / --deadline)")
    if done.returncode != 0:
        # the exception's own line first (a dispatcher's message lists every backend after it), then the tail
        headers = [line for line in done.stderr.splitlines() if _EXCEPTION_LINE.match(line)]
        status = f"exit status {done.returncode}" + (" (a signal)" if done.returncode < 0 else "")
        return failed_row(model, config, args.device, precision,
                          "\n".join([*headers[-1:], done.stderr.strip()[-1500:], status]))
    return json.loads(done.stdout.strip().splitlines()[-1])


def failed_row(model: str, config: str, device: str, precision: str, error: str) -> dict:
    return {"model": model, "config": config, "family": family(config), "device": device, "precision": precision,
            "error": error}


def best_mosos_at_or_below(rows: list[dict], peak_mib: float) -> dict | None:
    candidates = [r for r in rows if r["family"] in MOSOS_FAMILIES and "error" not in r
                  and r["peak_mib"] <= peak_mib]
    return min(candidates, key=lambda r: r["time_ratio"], default=None)


def _error_line(row: dict) -> str:
    lines = [line for line in row["error"].splitlines() if line.strip()]
    headers = [line for line in lines if _EXCEPTION_LINE.match(line)]
    return (headers[-1] if headers else lines[-1] if lines else "").replace("|", "/")[:200]


def table(model: str, rows: list[dict]) -> list[str]:
    gradients = any("grad_error" in r for r in rows)
    lines = [f"### {model}", "",
             "| configuration | time / eager | peak MiB | eager step ms | simulated / keep-all simulated | "
             "prepare s | compile s | " + ("grad error (eager noise) | " if gradients else "") + "note |",
             "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if gradients else "") + "---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | failed | | | | | | " + ("| " if gradients else "")
                         + f"{_error_line(r)} |")
            continue
        simulated = (f"{r['simulated_ms'] / r['keep_all_simulated_ms']:.2f}"
                     if r.get("simulated_ms") and r.get("keep_all_simulated_ms") else "")
        error = ""
        if gradients:
            error = f"{r['grad_error']:.1e} ({r['eager_noise']:.1e}) | " if "grad_error" in r else "| "
        lines.append(f"| {r['config']} | {r['time_ratio']:.2f} | {r['peak_mib']:.0f} | {r['eager_ms']:.0f} | "
                     f"{simulated} | {r['prepare_s']:.1f} | "
                     + (f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "") + f" | {error}{r['note']} |")
    lines += ["", "| torch configuration | its time / peak | fastest mosos at <= its peak | mosos time / peak | "
              "mosos / torch time |", "|---|---|---|---|---:|"]
    for r in rows:
        if "error" in r or r["family"] not in TORCH_FAMILIES:
            continue
        best = best_mosos_at_or_below(rows, r["peak_mib"])
        if best is None:
            lines.append(f"| {r['config']} | {r['time_ratio']:.2f} / {r['peak_mib']:.0f} MiB | none | | |")
        else:
            lines.append(f"| {r['config']} | {r['time_ratio']:.2f} / {r['peak_mib']:.0f} MiB | {best['config']} | "
                         f"{best['time_ratio']:.2f} / {best['peak_mib']:.0f} MiB | "
                         f"{best['time_ratio'] / r['time_ratio']:.2f} |")
    return lines + [""]


def plot(model: str, rows: list[dict], path: Path, where: str = "the CPU", gpu: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    families: dict[str, list[dict]] = {}
    for r in rows:
        if "error" not in r:
            families.setdefault(r["family"], []).append(r)
    for name, members in families.items():
        members = sorted(members, key=lambda r: r["peak_mib"])
        axes.plot([r["peak_mib"] for r in members], [r["time_ratio"] for r in members], marker="o",
                  linestyle="-" if len(members) > 1 else "none", label=name)
        for r in members:
            label = r["config"].replace("compile-budget-", "b").replace("mosos-compiled-", "c").replace("mosos-", "")
            axes.annotate(label, (r["peak_mib"], r["time_ratio"]), fontsize=7, xytext=(3, 3),
                          textcoords="offset points")
    axes.set_xlabel("peak rise of " + ("allocated GPU memory" if gpu else "live tensor storage")
                    + " in one step (MiB)")
    axes.set_ylabel("step time / eager (paired median)")
    axes.set_title(f"{model}: memory-time frontier on {where}")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _names(model: str, precision: str, device: str, results_dir: Path) -> tuple[Path, Path, Path, str]:
    """(results file, rows file, plot, section heading) of one model and precision."""
    if device == "cpu":
        return (results_dir / "frontier.md", results_dir / f"frontier_{model}.json",
                results_dir / f"frontier_{model}.png", model)
    stem = f"frontier_gpu_{model}_{precision}"
    return (results_dir / "frontier_gpu.md", results_dir / f"{stem}.json", results_dir / f"{stem}.png",
            f"{model}, {precision}")


def merged_rows(path: str, measured_by: str | None, measured_when: str | None, groups: list[tuple[str, str]],
                configs: list[str]) -> dict[tuple[str, str], list[dict]]:
    """The rows of a --rows-log for these models, precisions and configurations, each naming what measured it."""
    if not measured_by:
        raise SystemExit("--merge-rows needs --merge-command: the command and run that measured the rows")
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise SystemExit(f"--merge-rows {path}: {error.strerror or error}") from None
    found: dict[tuple[str, str], list[dict]] = {}
    skipped = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            group = (row["model"], row.get("precision", "fp32"))
            config = row["config"]
        except (ValueError, KeyError, TypeError) as error:
            raise SystemExit(f"{path}:{number}: not a frontier row ({error})") from None
        if group in groups and config in configs:
            row["command"] = measured_by
            row.pop("measured", None)
            if measured_when:
                row["measured"] = measured_when
            found.setdefault(group, []).append(row)
        else:
            skipped += 1
    if skipped:
        print(f"{path}: left out {skipped} row(s) of other models, precisions or configurations than asked for")
    if not found:
        raise SystemExit(f"{path}: no rows for {groups} among the configurations asked for")
    return found


def provenance(rows: list[dict], results: Path, heading: str, device_name: str) -> list[str]:
    """One paragraph per command that measured some of these rows, naming them; rows from before rows named their
    command keep the lines their section had."""
    lines: list[str] = []
    if any("command" not in row for row in rows) and results.exists():
        section = results.read_text().partition(f"\n## {heading}\n")[2].split("\n## ")[0]
        lines += [(line if line.startswith("Earlier rows") else f"Earlier rows: {line}") + "\n"
                  for line in section.split("\n|")[0].strip().split("\n")
                  if line.startswith("`") or line.startswith("Earlier rows")]
    by_command: dict[str, list[dict]] = {}
    for row in rows:
        if "command" in row:
            by_command.setdefault(row["command"], []).append(row)
    for command, measured in by_command.items():
        named = ", ".join(row["config"] for row in measured)
        when = f"{measured[0]['measured']}; " if measured[0].get("measured") else ""
        lines.append(f"`{command}` ({when}{device_name}) measured {named}.\n")
    return lines


def _shown(row: dict) -> str:
    if "error" in row:
        return _error_line(row)
    return f"{row['time_ratio']:.2f} x eager, {row['peak_mib']:.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--configs", default=",".join(all_configs()))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--time-limit", type=float, default=20.0, help="mosos' solve time limit, seconds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precisions", default="fp32", help="fp32 and/or bf16 (autocast), comma-separated")
    parser.add_argument("--jobs", type=int, default=1, help="configurations prepared at once (their timed phases "
                        "take turns)")
    parser.add_argument("--child-timeout", type=float, default=None, help="seconds one configuration may take")
    parser.add_argument("--deadline", type=float, default=None, help="seconds for the whole run: no configuration "
                        "starts after it, and each is stopped at it")
    parser.add_argument("--results-dir", default=str(RESULTS.parent))
    parser.add_argument("--rows-log", default=None, help="also append each row to this JSON-lines file as it ends")
    parser.add_argument("--rerun", default="", help="configurations to measure (again); the model's other rows are "
                        "kept from its results file (a row disturbed by other load on the machine, a new ratio)")
    parser.add_argument("--merge-rows", default=None, help="measure nothing: take the rows of this JSON-lines file "
                        "(a --rows-log written elsewhere) in place of the same configurations' rows in the results")
    parser.add_argument("--merge-command", default=None, help="with --merge-rows: the command and run that "
                        "measured them, for the results' headings")
    parser.add_argument("--merge-when", default=None, help="with --merge-rows: when and at which commit")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    precisions = [p for p in args.precisions.split(",") if p]
    if args.child:
        print(json.dumps(child(*args.child, args.rounds, args.time_limit, args.threads, args.device, precisions[0])))
        return 0
    if args.device == "cpu" and precisions != ["fp32"]:
        raise SystemExit("on the CPU the frontier is float32 only (--precisions fp32)")
    if args.jobs < 1:
        raise SystemExit("--jobs is at least 1")
    command = "python benchmarks/frontier.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    rerun = [c for c in args.rerun.split(",") if c]
    configs = [c for c in args.configs.split(",") if c]
    began = time.monotonic()
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    groups = [(model, precision) for model in args.models.split(",") for precision in precisions]
    merged: dict[tuple[str, str], dict[str, dict]] = {}
    if args.merge_rows:  # only the models and precisions the log has rows for: the others' files stay as they are
        merged = {group: {row["config"]: row for row in group_rows} for group, group_rows
                  in merged_rows(args.merge_rows, args.merge_command, args.merge_when, groups, configs).items()}
        groups = [group for group in groups if group in merged]
    rows: dict[tuple[str, str], dict[str, dict]] = {}
    for model, precision in groups:
        kept: dict[str, dict] = {}
        if rerun or args.merge_rows:
            kept_file = _names(model, precision, args.device, results_dir)[1]
            kept = {row["config"]: row for row in json.loads(kept_file.read_text())} if kept_file.exists() else {}
        if args.merge_rows:  # every row the file has, in its order, the merged ones in place of theirs, new ones after
            rows[(model, precision)] = kept | merged[(model, precision)]
        else:
            rows[(model, precision)] = {c: kept[c] for c in configs if c in kept and c not in rerun}
    # configuration-major: with a --deadline, every model and precision gets the first configurations
    tasks = [(model, precision, config) for config in configs for model, precision in groups
             if (not rerun or config in rerun) and not args.merge_rows
             and (model in LANGUAGE_MODELS or not config.startswith("mosos-split-"))]
    printing = threading.Lock()

    def measure(task):
        model, precision, config = task
        timeout = args.child_timeout
        left = None if args.deadline is None else args.deadline - (time.monotonic() - began)
        if left is not None and left < 10:
            row = failed_row(model, config, args.device, precision, "not started: the run's --deadline had passed")
        else:
            row = run_one(model, config, args, precision, timeout if left is None else min(timeout or left, left))
        row.update(command=command.strip(), measured=when)
        with printing:
            print(f"{model:7s} {precision:5s} {config:22s} {_shown(row)}", flush=True)
            if args.rows_log:
                with open(args.rows_log, "a") as log:
                    log.write(json.dumps(row) + "\n")
        return task, row

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for (model, precision, config), row in pool.map(measure, tasks):
            rows[(model, precision)][config] = row
    for model, precision in groups:
        ordered = (list(rows[(model, precision)].values()) if args.merge_rows
                   else [rows[(model, precision)][c] for c in configs if c in rows[(model, precision)]])
        results, rows_file, picture, heading = _names(model, precision, args.device, results_dir)
        device_name = next((r.get("device_name") for r in ordered if r.get("device_name")), args.device)
        lines = table(heading, ordered)
        print("\n".join(lines))
        plot(heading, ordered, picture, "the CPU" if args.device == "cpu" else f"{device_name} ({precision})",
             gpu=args.device != "cpu")
        section = "\n".join([f"## {heading}", "", *provenance(ordered, results, heading, device_name),
                             f"Plot: {picture.name}.", "", *lines[1:]])
        intro_title = "Memory-time frontier (CPU)" if args.device == "cpu" else "Memory-time frontier (GPU)"
        paragraphs = __doc__.split("\n\n")  # how it is measured (the CPU's or the GPU's), then the gradients
        intro = (paragraphs[2] if args.device == "cpu" else paragraphs[5]).strip() + "\n\n" + paragraphs[4].strip()
        write_section(results, f"# {intro_title}\n\n" + intro + "\n", section + "\n")
        rows_file.write_text(json.dumps(ordered, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
