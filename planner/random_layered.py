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


def random_layered_profile(n: int, seed: int = 0, **options):
    """The generated graph as a GraphProfile (importer options such as bandwidths pass through)."""
    from planner.importer import graph_to_profile_data
    from planner.profile import parse_profile

    data = random_layered_graph(n, seed)
    return parse_profile(graph_to_profile_data(data, **options), f"random layered graph n={n} seed={seed}")
