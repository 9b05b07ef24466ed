"""The mask transformers hands scaled_dot_product_attention while torch.export traces GPT-2 and BERT on CUDA (its
shape and strides), and whether the capture can take the memory-efficient kernel with it.

    python benchmarks/gpu_checks/attention_masks.py
"""
import sys, warnings
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import torch
import torch.nn.functional as F
import transformers.integrations.sdpa_attention as sa
from benchmarks.frontier import workload
from executor.capture.capture import capture
from torch.nn.attention import SDPBackend, sdpa_kernel
warnings.simplefilter("always")
real = F.scaled_dot_product_attention
seen = []
def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
    mask = None if attn_mask is None else (tuple(attn_mask.shape), attn_mask.stride(), attn_mask.dtype)
    seen.append(dict(q=(tuple(q.shape), q.stride(), q.dtype), k=k.stride(), v=v.stride(), mask=mask, dropout_p=dropout_p,
                     is_causal=is_causal, kw=list(kw), compiling=torch.compiler.is_compiling(), fake=type(q).__name__))
    return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)
sa.torch.nn.functional.scaled_dot_product_attention = spy
for name in ("gpt2", "bert"):
    work = workload(name, "cuda")
    seen.clear()
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            capture(work["model"], (), work["kwargs"], work.get("targets"), work["loss_fn"])
        print(name, "captured with efficient only")
    except Exception as e:
        print(name, "failed:", str(e)[:150])
    print(name, seen[:1], flush=True)
