"""Random layered graphs of any size: the benchmark family of Moccasin and Neural Topological Ordering.

The published graphs (`random_layered_n100`, `_n250` beside this checkout) are
named by their parameters: width exponent `w`, level-width variation `nlv`,
edge density `ed` between consecutive levels and skip-connection density
`scd`. This is our own generator of the same kind (not theirs): one source,
one sink, levels of about `n**w` nodes (each width drawn within +-`nlv` of
it), every node reading at least one node of the level above and read by at
least one of the level below, each other pair of consecutive levels linked
with probability `ed`, and with probability `scd` per node a skip link to a
node two or more levels further down (distance drawn geometrically, as in
the published graphs where most skips are short). Output sizes and durations
follow the published graphs' ranges: sizes in multiples of 10 from 10 to about
8,000 (mean about 2,000), durations uniform in 0..999. The answer is a
networkx node-link document in the published dialect (`out_cost`, `duration`,
links with keys "0"/"1", `graph.order` a random topological order), so it goes
through the same importer as the published files. Everything is drawn from
one `random.Random(seed)`: the same arguments give the same graph.
"""

from __future__ import annotations

import math
import random

from planner.importer import graph_to_profile_data
from planner.profile import parse_profile

# The published family's parameters (file names random_layered_n100_w0.27_nlv0.75_ed0.2_scd0.14, n250_w0.43...).
LEVEL_VARIATION = 0.75
EDGE_DENSITY = 0.2
SKIP_DENSITY = 0.14


def default_width_exponent(n: int) -> float:
    """About 20-25 levels whatever n, as in the published n100 (w 0.27, 21 levels) and n250 (w 0.43, 24 levels)."""
    return max(0.0, math.log(max(2.0, n / 22)) / math.log(max(n, 2)))


def random_layered_graph(
    n: int,
    seed: int = 0,
    width_exponent: float | None = None,
    level_variation: float = LEVEL_VARIATION,
    edge_density: float = EDGE_DENSITY,
    skip_density: float = SKIP_DENSITY,
) -> dict:
    """A node-link document of `n` nodes (n >= 3) in the random-layered dialect of `planner.importer`."""
    if n < 3:
        raise ValueError(f"a random layered graph needs at least 3 nodes (source, sink, one more), not {n}")
    rng = random.Random(seed)
    w = default_width_exponent(n) if width_exponent is None else width_exponent
    inner = n - 2
    mean_width = max(1.0, inner ** w)
    widths: list[int] = []
    while sum(widths) < inner:
        widths.append(max(1, round(mean_width * (1 + level_variation * rng.uniform(-1, 1)))))
    widths[-1] -= sum(widths) - inner
    if widths[-1] < 1:
        widths.pop()
    # node ids: 0 is the source, 1 the sink, inner nodes numbered level by level from 2
    levels: list[list[int]] = [[0]]
    next_id = 2
    for width in widths:
        levels.append(list(range(next_id, next_id + width)))
        next_id += width
    levels.append([1])
    edges: set[tuple[int, int]] = set()
    for upper, lower in zip(levels, levels[1:]):
        for target in lower:
            edges.add((rng.choice(upper), target))
        for source in upper:
            if not any((source, target) in edges for target in lower):
                edges.add((source, rng.choice(lower)))
        for source in upper:
            for target in lower:
                if rng.random() < edge_density:
                    edges.add((source, target))
    for depth, level in enumerate(levels[:-2]):
        for source in level:
            if rng.random() < skip_density:
                distance = 2
                while depth + distance < len(levels) - 1 and rng.random() < 0.75:
                    distance += 1
                edges.add((source, rng.choice(levels[min(depth + distance, len(levels) - 1)])))
    level_of = {node: depth for depth, level in enumerate(levels) for node in level}
    nodes = [
        {
            "name": node,
            "out_cost": 10 * max(1, min(820, round(rng.expovariate(1 / 200)))),
            "param_cost": 0,
            "duration": 0 if node in (0, 1) else rng.randrange(1000),
        }
        for node in range(n)
    ]
    links = [{"0": source, "1": target} for source, target in sorted(edges)]
    return {
        "directed": True,
        "multigraph": False,
        "graph": {
            "name": f"random_layered_n{n}_w{w:.2f}_nlv{level_variation:g}_ed{edge_density:g}_scd{skip_density:g}_seed{seed}",
            "order": _random_topological_order(n, edges, rng),
            "levels": [level_of[node] for node in range(n)],
        },
        "nodes": nodes,
        "links": links,
    }


def _random_topological_order(n: int, edges: set[tuple[int, int]], rng: random.Random) -> list[int]:
    """Kahn's algorithm picking a random ready node each time (the published orders are not level by level)."""
    users: list[list[int]] = [[] for _ in range(n)]
    missing = [0] * n
    for source, target in sorted(edges):
        users[source].append(target)
        missing[target] += 1
    ready = [node for node in range(n) if not missing[node]]
    order: list[int] = []
    while ready:
        node = ready.pop(rng.randrange(len(ready)))
        order.append(node)
        for user in users[node]:
            missing[user] -= 1
            if not missing[user]:
                ready.append(user)
    return order


def random_training_profile(
    forward_nodes: int, seed: int = 0, level_width: float = 3.0, bandwidth_gb_per_s: float | None = 12.0,
    algorithm_share: float = 0.3,
):
    """A training step over a generated layered forward graph: forward, a loss, and one backward node per forward node.

    For scale tests of the full model on graphs the project did not write: `2 * forward_nodes + 1` nodes.
    The forward graph is the random layered kind with levels of about `level_width` nodes (network-like:
    narrow, with skip links). Sizes are in MiB-scale bytes and times in ms so that PCIe transfers of
    `bandwidth_gb_per_s` take about as long as a node (offloading can hide, or not). The backward node of v
    reads the backward nodes of v's readers (the loss for the last one), v's inputs and v itself, as
    autograd does, and makes a tensor of v's size. `algorithm_share` of the nodes get three
    implementations (fast with a workspace, one slower with a smaller one, one slowest with none),
    as convolutions do.
    """
    width = max(1.0, level_width)
    exponent = math.log(width) / math.log(max(forward_nodes, 2)) if width > 1 else 0.0
    graph = random_layered_graph(forward_nodes, seed, width_exponent=exponent)
    rng = random.Random(seed + 1)
    mib = 1 << 20
    inputs: dict[int, list[int]] = {node: [] for node in range(forward_nodes)}
    for link in graph["links"]:
        inputs[link["1"]].append(link["0"])
    users: dict[int, list[int]] = {node: [] for node in range(forward_nodes)}
    for target, sources in inputs.items():
        for source in sources:
            users[source].append(target)
    order = graph["graph"]["order"]
    size = {node["name"]: node["out_cost"] * mib // 100 for node in graph["nodes"]}
    time_ms = {node["name"]: max(0.01, node["duration"] / 100) for node in graph["nodes"]}

    def implementations(node: int, base_ms: float, output_bytes: int) -> list[dict]:
        if rng.random() >= algorithm_share:
            return [{"name": "default", "time_ms": base_ms, "workspace_bytes": 0}]
        workspace = int(output_bytes * rng.uniform(0.5, 3.0))
        return [
            {"name": "fast", "time_ms": base_ms, "workspace_bytes": workspace},
            {"name": "lean", "time_ms": round(base_ms * rng.uniform(1.1, 1.4), 4), "workspace_bytes": workspace // 4},
            {"name": "none", "time_ms": round(base_ms * rng.uniform(1.5, 2.5), 4), "workspace_bytes": 0},
        ]

    nodes = []
    for node in order:
        nodes.append({
            "id": f"f{node}", "name": f"f{node}", "kind": "forward", "op_type": "layer",
            "output_bytes": size[node], "inputs": [f"f{i}" for i in inputs[node]],
            "implementations": implementations(node, time_ms[node], size[node]),
        })
    sink = order[-1]
    nodes.append({
        "id": "loss", "name": "loss", "kind": "loss", "op_type": "loss", "output_bytes": size[sink],
        "inputs": [f"f{sink}"], "implementations": [{"name": "default", "time_ms": 0.05, "workspace_bytes": 0}],
    })
    for node in reversed(order):
        upstream = [f"b{u}" for u in users[node]] or ["loss"]
        nodes.append({
            "id": f"b{node}", "name": f"b{node}", "kind": "backward", "op_type": "layer_backward",
            "output_bytes": size[node], "inputs": upstream + [f"f{i}" for i in inputs[node]] + [f"f{node}"],
            "implementations": implementations(node, 2 * time_ms[node], size[node]),
        })
    total = sum(node["output_bytes"] for node in nodes)
    document = {
        "schema_version": "1.0",
        "name": f"random-training-{forward_nodes}-w{width:g}-seed{seed}",
        "hardware": {
            "name": "generated device", "memory_capacity_bytes": total,
            "d2h_bandwidth_gb_per_s": bandwidth_gb_per_s, "h2d_bandwidth_gb_per_s": bandwidth_gb_per_s,
        },
        "fixed_memory": {"parameters_bytes": 64 * mib},
        "nodes": nodes,
        "provenance": {"source": "estimated", "notes": f"generated by planner.random_layered (seed {seed})"},
    }
    return parse_profile(document, f"generated training graph ({forward_nodes} forward nodes, seed {seed})")


def random_layered_profile(n: int, seed: int = 0, **options):
    """The generated graph as a GraphProfile (importer options such as bandwidths pass through)."""

    data = random_layered_graph(n, seed)
    return parse_profile(graph_to_profile_data(data, **options), f"random layered graph n={n} seed={seed}")
