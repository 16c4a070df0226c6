"""Which rank runs each matrix's Newton-Schulz: cost model and balanced assignment.

A sharded Muon (HSDP, megatron's distributed optimizer) gathers each matrix on one owner rank, runs
Newton-Schulz there once and sends the update back. Newton-Schulz cost grows with the cube of a
matrix's short side, not with its size, so assigning owners by element count (what a memory layout
balances) leaves some ranks with far more Newton-Schulz work than others when aspect ratios differ
(attention vs MLP matrices). Owners here are chosen by the flop count itself.
"""

from __future__ import annotations


def ns_flops(shape, steps: int = 5) -> float:
    """Multiply-add flops (x2) of ``steps`` quintic Newton-Schulz iterations on a matrix of ``shape``.

    On the wide orientation (m <= n): per step ``X Xt`` (2 m^2 n), ``A A`` (2 m^3) and ``B X``
    (2 m^2 n), plus the normalisation (2 m n, negligible but keeps zero-step costs positive).
    """
    rows, cols = int(shape[0]), int(shape[1])
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m ** 3) + 2.0 * m * n


def assign_owners(costs, n_ranks: int) -> list[int]:
    """Owner rank of each item: longest-processing-time first onto the least-loaded rank.

    Deterministic (ties broken by item index, then rank index) so every rank computes the same
    assignment from the same list without communicating. The greedy result is at most 4/3 of the
    optimal maximum load (Graham's bound).
    """
    if n_ranks < 1:
        raise ValueError(f"assign_owners: n_ranks must be >= 1, got {n_ranks}")
    loads = [0.0] * n_ranks
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i)):
        rank = min(range(n_ranks), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += float(costs[index])
    return owners


def round_robin_owners(n_items: int, n_ranks: int) -> list[int]:
    """The naive assignment (item i on rank i mod n), for comparison."""
    return [i % n_ranks for i in range(n_items)]


def load_imbalance(costs, owners, n_ranks: int) -> float:
    """max / mean of the per-rank summed cost (1.0 is perfect balance)."""
    loads = [0.0] * n_ranks
    for cost, owner in zip(costs, owners, strict=True):
        loads[owner] += float(cost)
    mean = sum(loads) / n_ranks
    return max(loads) / mean if mean else 1.0
