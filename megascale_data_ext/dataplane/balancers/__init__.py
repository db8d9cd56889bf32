"""Balancers: number partitioning of items into k bins of near-equal cost, and the step levels.

`partition(costs, k, method=...)` with an optional per-bin token cap and optional exact bin
sizes. Methods are registered by name (`register_balancer`); built in are ``greedy`` (LPT,
`lpt`) and ``kk`` (Karmarkar–Karp largest differencing, `karmarkar_karp`). The paper's levels
over buckets and micro-batches (`balance_step`) live in `levels`.

Modules, each importing only those before it: `bins` (bin state, caps, input checks),
`merge` (balanced merge of sorted k-tuples), `lpt`, `karmarkar_karp`, `registry` (names,
`partition`), `levels`, `microbatches` (a bucket's documents packed into micro-batches under
the cap, and the repair where packing needs one more than counted), `variable_count` (as many
micro-batches per bucket as its documents need, where the loss is per token), `hybrid_cp` (each document its own power-of-two CP group
of DP×CP GPUs, whole short documents balanced around them).
"""

from megascale_data_ext.dataplane.balancers.karmarkar_karp import kk
from megascale_data_ext.dataplane.balancers.levels import BalanceResult, Level, balance_step
from megascale_data_ext.dataplane.balancers.lpt import greedy
from megascale_data_ext.dataplane.balancers.registry import (
    Balancer,
    balancer_names,
    get_balancer,
    partition,
    register_balancer,
)

__all__ = [
    "BalanceResult",
    "Balancer",
    "Level",
    "balance_step",
    "balancer_names",
    "get_balancer",
    "greedy",
    "kk",
    "partition",
    "register_balancer",
]
