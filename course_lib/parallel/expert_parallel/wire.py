"""Bytes each rank sends and receives in the expert all-to-alls, from the routing alone.

For one MoE layer and one forward on EP rank r (L local experts, ep ranks, C channels, b bytes an
element, s[q] = rows r routes to rank q's experts after dropping, t[q] = rows rank q routes to r's):

* counts:   sent (ep - 1) * L * 8 bytes (int64), received the same;
* dispatch: sent sum_{q != r} s[q] * C * b, received sum_{q != r} t[q] * C * b;
* combine:  the mirror image (sent the dispatch's received, received its sent).

Backward repeats dispatch and combine with the roles swapped (the gradient of the combine travels
as a dispatch, and back), so a training step moves each row-byte twice in each direction. Rows a
rank keeps for itself (q = r) never touch the wire. :func:`expected_bytes` computes this;
:func:`measured_bytes` adds up what a dispatcher's log says was handed to all_to_all_single.
"""
from __future__ import annotations


def expected_bytes(send_rows: list[int], recv_rows: list[int], rank: int, n_local: int, d_model: int,
                   elem_bytes: int, backward: bool = True) -> dict[str, tuple[int, int]]:
    """{exchange: (bytes sent, bytes received)} on the wire for one MoE layer's forward (and its
    backward when ``backward``) on EP rank ``rank``. send_rows[q] / recv_rows[q]: rows this rank
    routes to rank q's experts / rank q routes to this rank's, after dropping. Exchanges: "counts",
    "dispatch", "combine" (+ "dispatch backward", "combine backward")."""
    ep = len(send_rows)
    counts = (ep - 1) * n_local * 8
    row = d_model * elem_bytes
    out_b = sum(s for q, s in enumerate(send_rows) if q != rank) * row
    in_b = sum(t for q, t in enumerate(recv_rows) if q != rank) * row
    out = {"counts": (counts, counts), "dispatch": (out_b, in_b), "combine": (in_b, out_b)}
    if backward:  # the combine's gradient travels first, as a dispatch would; then the dispatch's
        out.update({"combine backward": (out_b, in_b), "dispatch backward": (in_b, out_b)})
    return out


def measured_bytes(log: list[dict], rank: int) -> dict[str, tuple[int, int]]:
    """{exchange: (bytes sent, bytes received)} summed over a dispatcher's logged exchanges
    (what was handed to all_to_all_single), leaving out the rows a rank keeps for itself."""
    out: dict[str, tuple[int, int]] = {}
    for e in log:
        sent = sum(s for q, s in enumerate(e["send_rows"]) if q != rank) * e["row_bytes"]
        recv = sum(s for q, s in enumerate(e["recv_rows"]) if q != rank) * e["row_bytes"]
        a, b = out.get(e["what"], (0, 0))
        out[e["what"]] = (a + sent, b + recv)
    return out
