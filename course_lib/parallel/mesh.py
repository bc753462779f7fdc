"""A device mesh for 3-D (4-D) parallelism: which rank is which (dp, tp, pp, cp) coordinate, and
the process groups that connect a rank to its peers along each dimension.

``world_size = pp * dp * cp * tp`` ranks are laid out row-major in that order, **tp innermost**::

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

Why this order (the one Megatron-LM uses, "tp-cp-dp-pp" from the inside out): the innermost
dimension gets adjacent ranks, and adjacent ranks share a node (torchrun numbers a node's GPUs
consecutively), so the dimension that talks most should be innermost:

* **tp** all-reduces activations twice per layer, forward and backward, on the critical path:
  it needs NVLink, so TP peers are adjacent ranks (tp <= GPUs per node);
* **cp** (context parallel) passes K/V blocks around a ring once per attention layer: next;
* **dp** all-reduces gradients once per step, overlapped with backward: can cross nodes;
* **pp** sends one activation per micro-batch between neighbouring stages, point to point,
  the least traffic of all: outermost, it spans nodes.

:func:`mesh_layout` is pure arithmetic (no torch, no process group): the labs draw it.
:func:`build_mesh` creates the groups with ``dist.new_group`` - every rank creates *every* group,
in the same order (a ``new_group`` call is collective over the whole world, even for ranks that
are not in the group) - and returns a :class:`ProcessMesh` for this rank. There is no global
mesh: the object is passed to whoever needs it (the strategy holds it).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from course_lib.validate import check_int

DIMS = ("pp", "dp", "cp", "tp")  # outermost -> innermost (row-major order of the ranks)


@dataclass(frozen=True)
class MeshLayout:
    """The sizes of the four dimensions; ``world_size`` is their product. Pure arithmetic."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self):
        for name in DIMS:
            check_int(name, getattr(self, name), 1)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes in rank order, outermost first: (pp, dp, cp, tp)."""
        return tuple(getattr(self, d) for d in DIMS)

    def rank_of(self, **coords: int) -> int:
        """Global rank at ``coords`` (missing dims are 0), e.g. ``rank_of(pp=1, tp=1)``."""
        unknown = set(coords) - set(DIMS)
        if unknown:
            raise ValueError(f"unknown mesh dimension(s) {sorted(unknown)}; dimensions: {', '.join(DIMS)}")
        rank = 0
        for d in DIMS:
            i = coords.get(d, 0)
            check_int(d, i, 0, getattr(self, d) - 1, f"{d} size - 1")
            rank = rank * getattr(self, d) + i
        return rank

    def coords_of(self, rank: int) -> dict[str, int]:
        """``{"pp": i, "dp": j, "cp": k, "tp": l}`` of a global rank."""
        check_int("rank", rank, 0, self.world_size - 1, "world_size - 1")
        out = {}
        for d in reversed(DIMS):
            rank, out[d] = divmod(rank, getattr(self, d))
        return {d: out[d] for d in DIMS}

    def group_ranks(self, dim: str) -> list[list[int]]:
        """Every group along ``dim``: lists of global ranks that differ only in ``dim`` (ordered by
        their ``dim`` coordinate). ``dim`` may also be "mp" (model parallel: tp x cp x pp, the
        ranks that share one data-parallel replica, i.e. all ranks with the same dp coordinate) or
        "dp_cp" (dp x cp: the ranks that hold the *same* weights - same stage, same tp shard - and
        read different tokens, so the group gradients are averaged or sharded over; it is the dp
        group when cp = 1, as torchtitan's flattened "dp_shard_cp")."""
        along = {"mp": ("pp", "cp", "tp"), "dp_cp": ("dp", "cp")}.get(dim, (dim,))
        for d in along:
            if d not in DIMS:
                raise ValueError(f"dim must be one of {', '.join(DIMS)}, 'mp' or 'dp_cp', got {dim!r}")
        fixed = [d for d in DIMS if d not in along]
        groups = []
        for values in itertools.product(*(range(getattr(self, d)) for d in fixed)):
            base = dict(zip(fixed, values))
            members = [self.rank_of(**base, **dict(zip(along, v)))
                       for v in itertools.product(*(range(getattr(self, d)) for d in along))]
            groups.append(members)
        return groups

    def draw(self, rank_labels: dict[int, str] | None = None) -> str:
        """An ASCII picture of the mesh: one row per (pp, dp, cp), one column per tp rank, each cell
        the global rank; ``rank_labels`` (rank -> text) adds a line per rank underneath."""
        cell = max(4, len(str(self.world_size - 1)) + 2)
        head = " " * 16 + "".join(f"tp{t}".center(cell + 2) for t in range(self.tp))
        lines = [f"{self.world_size} ranks = pp {self.pp} x dp {self.dp} x cp {self.cp} x tp {self.tp} "
                 f"(tp innermost: TP peers are adjacent ranks)", head]
        for p, d, c in itertools.product(range(self.pp), range(self.dp), range(self.cp)):
            row = f"pp{p} dp{d}" + (f" cp{c}" if self.cp > 1 else "")
            cells = "".join(f"[{self.rank_of(pp=p, dp=d, cp=c, tp=t):^{cell}}]" for t in range(self.tp))
            lines.append(f"{row:<16}{cells}")
        if rank_labels:
            lines.append("")
            width = len(str(self.world_size - 1))
            for r in range(self.world_size):
                if r in rank_labels:
                    lines.append(f"rank {r:>{width}}: {rank_labels[r]}")
        return "\n".join(lines)

    def describe(self, n_layers: int | None = None, n_heads: int | None = None,
                 vocab_size: int | None = None, balance: list[int] | None = None) -> dict[int, str]:
        """rank -> what it holds, in words (for :meth:`draw`): its pipeline stage's blocks (and the
        embedding / head ends), its tensor-parallel slice of the heads and vocabulary, and which
        1/dp share of each global batch it reads. ``balance``: blocks per stage (default the even
        split), e.g. :func:`course_lib.estimate.stage_split.stage_split`'s; with ``k * pp`` entries
        (interleaved, k virtual stages per rank) pipeline rank p holds stages p, p + pp, ..."""
        counts = balance
        if counts is None and n_layers is not None:  # the pipeline's even split (stages.even_split)
            base, extra = divmod(n_layers, self.pp)
            counts = [base + (1 if s < extra else 0) for s in range(self.pp)]
        if counts is not None and len(counts) % self.pp:
            raise ValueError(f"balance must have a multiple of pp = {self.pp} entries (one per stage), got {list(counts)}")
        out = {}
        for r in range(self.world_size):
            c = self.coords_of(r)
            parts = []
            if counts is not None:
                held = []
                for s in range(c["pp"], len(counts), self.pp):
                    start = sum(counts[:s])
                    blocks = f"blocks {start}-{start + counts[s] - 1}" if counts[s] > 1 else f"block {start}"
                    held += ((["embeddings"] if s == 0 else []) + [blocks]
                             + (["final norm, head, loss"] if s == len(counts) - 1 else []))
                stages = "stage" if len(counts) == self.pp else "stages"
                label = ", ".join(str(s) for s in range(c["pp"], len(counts), self.pp))
                parts.append(f"{stages} {label}: " + ", ".join(held))
            if self.tp > 1:
                tp_part = []
                if n_heads is not None:
                    per = n_heads // self.tp
                    tp_part.append(f"heads {c['tp'] * per}-{(c['tp'] + 1) * per - 1}")
                if vocab_size is not None:
                    per = vocab_size // self.tp
                    tp_part.append(f"vocab {c['tp'] * per}-{(c['tp'] + 1) * per - 1}")
                parts.append(f"tp shard {c['tp']}/{self.tp}" + (f" ({', '.join(tp_part)})" if tp_part else ""))
            if self.cp > 1:
                parts.append(f"sequence chunk {c['cp']}/{self.cp}")
            parts.append(f"batch share {c['dp']}/{self.dp}")
            out[r] = "; ".join(parts)
        return out


def mesh_layout(world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, dp: int = 0) -> MeshLayout:
    """The layout for ``world_size`` ranks; ``dp = 0`` means "what is left": world / (tp*pp*cp).
    ValueError naming the sizes when they do not multiply to the world size."""
    check_int("world_size", world_size, 1)
    for name, v in (("tp", tp), ("pp", pp), ("cp", cp)):
        check_int(name, v, 1)
    check_int("dp", dp, 0)
    model = tp * pp * cp
    if dp == 0:
        if world_size % model:
            raise ValueError(f"world size {world_size} is not a multiple of tp*pp*cp = {tp}*{pp}*{cp} = {model}; "
                             f"start a multiple of {model} ranks")
        dp = world_size // model
    if dp * model != world_size:
        raise ValueError(f"dp*tp*pp*cp = {dp}*{tp}*{pp}*{cp} = {dp * model} must equal the world size "
                         f"{world_size}")
    return MeshLayout(dp=dp, tp=tp, pp=pp, cp=cp)


@dataclass
class ProcessMesh:
    """One rank's view of the mesh: ``layout``, its global ``rank``, its ``coords`` and, per
    dimension (and "mp"), the ``groups`` it belongs to and the ``ranks`` of that group (global
    ranks, ordered by the coordinate). A dimension of size 1 still has a (one-rank) group."""

    layout: MeshLayout
    rank: int
    coords: dict[str, int]
    groups: dict[str, Any] = field(repr=False)
    ranks: dict[str, list[int]]

    def size(self, dim: str) -> int:
        return len(self.ranks[dim])

    def draw(self, rank_labels: dict[int, str] | None = None) -> str:
        return self.layout.draw(rank_labels)


def build_mesh(layout: MeshLayout, rank: int | None = None, backend: str | None = None) -> ProcessMesh:
    """Create every group of ``layout`` (collective: every rank of the default group must call
    this, with the same layout) and return this rank's :class:`ProcessMesh`."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("build_mesh needs a process group: start ranks with course_lib.parallel.run_ranks "
                           "or torchrun + init_distributed()")
    world = dist.get_world_size()
    if layout.world_size != world:
        raise ValueError(f"the mesh has {layout.world_size} ranks (pp {layout.pp} x dp {layout.dp} x cp "
                         f"{layout.cp} x tp {layout.tp}) but the process group has {world}")
    rank = dist.get_rank() if rank is None else rank
    groups, ranks = {}, {}
    for dim in (*DIMS, "mp", "dp_cp"):
        for members in layout.group_ranks(dim):  # every rank creates every group, same order
            group = dist.new_group(members, backend=backend)
            if rank in members:
                groups[dim], ranks[dim] = group, members
    return ProcessMesh(layout, rank, layout.coords_of(rank), groups, ranks)
