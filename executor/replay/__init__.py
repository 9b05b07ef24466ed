"""Replay: a schedule run in training. codegen writes the step as Python code (one line per computation, offload,
prefetch, wait and free), replay wraps it in a module and an autograd function, runtime and transfers run its
streams and pinned host buffers, accountant keeps the ledger that holds the step to the budget, compiled_nodes and
regions run planning nodes as Inductor kernels, and reference checks a replay against plain PyTorch."""
