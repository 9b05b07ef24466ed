"""DistributedDataParallel over a planned module: two ranks (gloo, separate processes), each training the planned
module under DDP beside a plain copy under DDP of its own; after every step the averaged gradients and the updated
weights are plain PyTorch's, bit for bit."""

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
import copy, json, os, sys
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
ddp, plain_ddp = DDP(planned), DDP(plain)
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
# both ranks reach the teardown together: a rank that tears gloo down while its peer still talks to it can abort
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
