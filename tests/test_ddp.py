"""DistributedDataParallel over a planned module: two ranks (gloo, separate processes), each training the planned
module under DDP beside a plain copy under DDP of its own; after every step the averaged gradients and the updated
weights are plain PyTorch's, bit for bit. DDP's buckets, a copy of the gradients unless it is built with
gradient_as_bucket_view=True, are refused where the budget has no room for them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parent.parent

RANK = '''
import copy, gc, json, os, sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import executor

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
layers = [nn.Linear(64, 128), nn.Tanh(), nn.Dropout(0.1)]
for _ in range(4):
    layers += [nn.Linear(128, 128), nn.GELU()]
model = nn.Sequential(*layers, nn.Linear(128, 10))
plain = copy.deepcopy(model)
generator = torch.Generator().manual_seed(10 + rank)  # each rank its own data
x, y = torch.randn(1024, 64, generator=generator), torch.randint(0, 10, (1024,), generator=generator)
planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, memory_ratio=0.7, time_limit_s=2, workers=1,
                            optimizer="momentum", progress=False)
# the planned module's gradients in DDP's buckets, as the budget needs; the plain copy as DDP builds it by default
ddp, plain_ddp = DDP(planned, gradient_as_bucket_view=True), DDP(plain)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
plain_optimizer = torch.optim.SGD(plain_ddp.parameters(), lr=0.1, momentum=0.9)
same = []
for step in range(3):
    x, y = torch.randn(1024, 64, generator=generator), torch.randint(0, 10, (1024,), generator=generator)
    optimizer.zero_grad()
    plain_optimizer.zero_grad()
    torch.manual_seed(100 * rank + step)
    loss = ddp(x, targets=y)
    loss.backward()
    torch.manual_seed(100 * rank + step)
    plain_loss = F.cross_entropy(plain_ddp(x), y)
    plain_loss.backward()
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters())]
    same.append(torch.equal(loss, plain_loss) and all(torch.equal(a, b) for a, b in grads))
    optimizer.step()
    plain_optimizer.step()
weights = all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
# the gradients were averaged across ranks: both ranks hold the same weights
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(2)]
dist.all_gather(gathered, flat)
print(json.dumps({"rank": rank, "steps_bitwise": same, "weights_bitwise": weights,
                  "ranks_agree": torch.equal(gathered[0], gathered[1])}), flush=True)
# Teardown in order, as torch's examples do: the DDP wrappers (their reducers hold the process group and gloo's work)
# go first, then both ranks meet and the group is destroyed while the interpreter is whole. Once in CI, with the
# wrappers left to the interpreter's exit, rank 0 aborted after its answer ("terminate called without an active
# exception", a C++ thread of gloo's torn down by the exit).
del ddp, plain_ddp, optimizer, plain_optimizer
gc.collect()
dist.barrier()
dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_over_a_planned_module_is_plain_ddp_bit_for_bit(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = _free_port()
    processes = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        processes.append(subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, cwd=REPO, env=env))
    results = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, f"rank exited {process.returncode}\nstdout: {out[-2000:]}\nstderr: {err[-3000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    for result in results:
        assert result["steps_bitwise"] == [True, True, True], result
        assert result["weights_bitwise"] and result["ranks_agree"], result


ONE_RANK = '''
import gc, json, os, sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import executor
from executor.errors import ReplayError
from executor.measure.allocations import AllocationTrace

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 8))
generator = torch.Generator().manual_seed(0)
x, y = torch.randn(2048, 64, generator=generator), torch.randint(0, 8, (2048,), generator=generator)
budget = int(sys.argv[1])
planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=budget, time_limit_s=3, workers=1,
                            optimizer="momentum", progress=False, cache=False, timed_steps=0)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
result = {"peak": planned.schedule.summary.peak_memory_bytes,
          "gradients": planned.profile.fixed_memory.gradients_bytes}
try:
    DDP(planned)(x, y)
    result["default"] = "ran"
except ReplayError as error:
    result["default"] = str(error)
ddp = DDP(planned, gradient_as_bucket_view=True)


def held() -> int:
    """Live storage the step begins with: parameters, gradients (views of DDP's buckets after its first backward),
    optimizer state, data."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None), x, y]
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


peaks = []
for step in range(4):
    optimizer.zero_grad(set_to_none=False)
    before = held()
    with AllocationTrace() as forward:  # a trace per phase: kineto drops the free of a block older than its trace
        loss = ddp(x, y)
    with AllocationTrace() as backward:
        loss.backward()
    del loss
    if step >= 2:  # DDP rebuilds its buckets in its second forward, freeing the first ones (which a trace begun
        # after their allocation cannot see); from then on every gradient is a view of the buckets, seen by held()
        peaks.append(before + max(forward.peak_bytes, forward.held_bytes + backward.peak_bytes))
    optimizer.step()
result["view_peaks"] = peaks
print(json.dumps(result), flush=True)
del ddp, optimizer  # the reducer before the group it holds (see RANK)
gc.collect()
dist.destroy_process_group()
'''


def _one_rank(tmp_path, budget: int) -> dict:
    script = tmp_path / "one_rank.py"
    script.write_text(ONE_RANK)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1")
    process = subprocess.run([sys.executable, str(script), str(budget)], capture_output=True, text=True, cwd=REPO,
                             env=env, timeout=300)
    assert process.returncode == 0, f"stdout: {process.stdout[-2000:]}\nstderr: {process.stderr[-3000:]}"
    return json.loads(process.stdout.strip().splitlines()[-1])


def test_ddp_buckets_the_budget_has_no_room_for_are_refused_and_bucket_views_fit(tmp_path):
    """A budget with room for the plan's peak but not for another copy of the gradients (the model's 4 MiB weight):
    DDP as built by default is refused, before its step; built with gradient_as_bucket_view=True it trains, and the
    live tensor storage of each step stays within the budget."""
    budget = 49 << 20
    result = _one_rank(tmp_path, budget)
    assert result["peak"] <= budget < result["peak"] + result["gradients"], result  # the case this test is about
    assert "DistributedDataParallel keeps a copy of the gradients in its buckets" in result["default"], result
    assert "gradient_as_bucket_view=True" in result["default"], result
    assert len(result["view_peaks"]) == 2 and max(result["view_peaks"]) <= budget, result
