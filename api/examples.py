"""A tiny profile for the OpenAPI page, so 'Try it out' works as shipped."""

from __future__ import annotations

MIB = 2**20


def _node(node_id, kind, op_type, output_mib, inputs, impls, forward_node=None):
    node = {
        "id": node_id,
        "kind": kind,
        "op_type": op_type,
        "output_bytes": output_mib * MIB,
        "inputs": inputs,
        "implementations": [{"name": name, "time_ms": time_ms, "workspace_bytes": ws_mib * MIB} for name, time_ms, ws_mib in impls],
    }
    if forward_node:
        node["forward_node"] = forward_node
    return node


EXAMPLE_PROFILE = {
    "schema_version": "1.0",
    "name": "example: two convolutions",
    "hardware": {
        "name": "example GPU",
        "memory_capacity_bytes": 1024 * MIB,
        "d2h_bandwidth_gb_per_s": 12.0,
        "h2d_bandwidth_gb_per_s": 12.0,
        "transfer_latency_ms": 0.01,
    },
    "fixed_memory": {"inputs_bytes": 16 * MIB, "parameters_bytes": 8 * MIB, "gradients_bytes": 8 * MIB},
    "nodes": [
        _node("conv1", "forward", "conv2d", 64, [], [("implicit_gemm", 2.0, 0), ("winograd", 1.2, 32)]),
        _node("relu1", "forward", "relu", 64, ["conv1"], [("default", 0.3, 0)]),
        _node("conv2", "forward", "conv2d", 64, ["relu1"], [("implicit_gemm", 2.0, 0), ("fft", 1.0, 96)]),
        _node("loss", "loss", "cross_entropy", 1, ["conv2"], [("default", 0.1, 0)]),
        _node("conv2_grad", "backward", "conv2d_backward", 64, ["loss", "relu1"], [("default", 4.0, 16)], "conv2"),
        _node("relu1_grad", "backward", "relu_backward", 64, ["conv2_grad", "relu1"], [("default", 0.3, 0)], "relu1"),
        _node("conv1_grad", "backward", "conv2d_backward", 8, ["relu1_grad"], [("default", 3.0, 16)]),
    ],
    "provenance": {"source": "handmade", "notes": "example for the API documentation"},
}
