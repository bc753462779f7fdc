"""Rows an expert rank received, regrouped by local expert (and back).

After the dispatch all-to-all, rank r holds the rows of every source rank q in turn, each source's
rows already grouped by r's local experts: [q=0: l=0, l=1, ...][q=1: l=0, ...]... Its experts want
them grouped by expert: [l=0: q=0, q=1, ...][l=1: ...]. :func:`group_by_local_expert` permutes,
:func:`ungroup` puts the expert outputs back in received order for the combine.
"""
from __future__ import annotations

import torch


def group_by_local_expert(rows: torch.Tensor, recv_counts: torch.Tensor):
    """rows [M, C] in (source, local expert) order, recv_counts [ep, L] int64 (rows from source q
    for local expert l) -> (rows grouped by local expert [M, C], counts per local expert [L], the
    permutation index [M] for :func:`ungroup`)."""
    ep, L = recv_counts.shape
    segment = torch.repeat_interleave(torch.arange(ep * L, device=rows.device), recv_counts.reshape(-1))
    key = (segment % L) * ep + segment // L  # (local expert, source) order
    index = torch.argsort(key, stable=True)
    return rows[index], recv_counts.sum(0), index


def ungroup(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`group_by_local_expert`'s permutation: back to (source, local expert) order."""
    return rows[torch.argsort(index)]
