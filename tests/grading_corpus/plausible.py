"""One wrong-but-plausible answer per exercise: a learner's honest mistake, not an attack.

Each must lose marks in ``course check`` (a visible test cell fails in the learner's kernel, or
one of the grader's own probes of a visible cell says no) and in ``course grade``, with a message
that names the property broken in the learner's words. A visible cell that passes in the kernel
but is marked "wrong" by the grader's comparison of recorded values would let the two disagree
(``course check`` would say full marks), so the sweep asserts the failure is of the first kind.

``PLAUSIBLE[exercise] = (old, new, words)``: in the one answer cell of the solution notebook
that contains ``old``, ``old`` becomes ``new``; ``words`` must appear in the failing visible
test's message. 01's (Part 3's dominant part) is graded in tests/test_grading_batch.py; 05's,
07's and 13's honest partials (:data:`tests.test_grading_batch.PARTIALS`) have their words in
:data:`PARTIAL_WORDS`; 13 has a second mistake here (the merge writes into its inputs).
"""
from __future__ import annotations

from tests.grading_corpus import answer_ids, answer_source, patched

PLAUSIBLE = {
    # every message of the ring is the whole tensor, not one of p chunks
    "00": ("2 * (world_size - 1) * (numel / world_size) * bytes_per_element",
           "2 * (world_size - 1) * numel * bytes_per_element", "bytes sent per rank"),
    # the stages shard in the wrong order: stage 1 shards the parameters
    "02": ('["optimizer", "grads", "params"][:stage]', '["params", "grads", "optimizer"][:stage]',
           "stage 1 shards the optimizer state only"),
    # operator precedence: & binds tighter than |, so global keys are visible from the past
    "04": ("(j <= i) & ((i - j < window) | (j < n_global))", "(j <= i) & (i - j < window) | (j < n_global)",
           "never attend a later key (causal)"),
    # the all-reduce sums the gradients and nobody divides by the number of ranks
    "08": ("flat = flat[:total] / self.world_size", "flat = flat[:total]", "differs from the single-process value"),
    # round-robin ownership: balanced enough, but not the contract's rule
    "09": ("owner = min(range(self.world_size), key=lambda r: self.owned_elements[r])",
           "owner = len(self.owner) % self.world_size", "ownership rule"),
    # the bias of the row-parallel layer goes in before the reduce: it is counted tp times
    "10": ("y = reduce_from_tp(F.linear(x, self.weight), self.group)\n"
           "        return y if self.bias is None else y + self.bias",
           "return reduce_from_tp(F.linear(x, self.weight, self.bias), self.group)", "bias was added 2 times"),
    # the warm-up read off a 4-stage table: never more than 3 forwards
    "11": ("warmup = min(pp - stage - 1, m)", "warmup = min(pp - stage - 1, m, 3)", "warm-up"),
    # 13B on one node without ZeRO: 16 bytes per parameter over tp=2 does not fit in 80 GB
    "12": ("LAYOUT_13B = dict(tp=2, pp=1, dp=4, zero_stage=3,", "LAYOUT_13B = dict(tp=2, pp=1, dp=4, zero_stage=0,",
           "LAYOUT_13B"),
    # the merge reuses the caller's tensors as its output
    "13": ("out = (out_a * w_a.unsqueeze(-1) + out_b * w_b.unsqueeze(-1)) / denom",
           "out = out_a.mul_(w_a.unsqueeze(-1)).add_(out_b * w_b.unsqueeze(-1)).div_(denom)",
           "changed the out_a it was given"),
    # one scale per row (rowwise), not per 1 x 128 tile: the hot first tile sets every tile's scale
    "15": ("    amax = t.abs().amax(dim=-1)", "    amax = t.abs().amax(dim=(1, 2)).unsqueeze(1).expand(rows, tiles)",
           "should land exactly on E4M3's largest"),
}

# the words of the honest partials of tests/test_grading_batch.PARTIALS
PARTIAL_WORDS = {"05": "clip", "07": "Verify the new file *before* deleting", "13": "NaN",
                 "14": "put each back at its row of x"}


def plausible_notebook(sol: dict, number: str) -> dict:
    """The solution notebook ``sol`` of exercise ``number`` with its plausible mistake."""
    old, new, _ = PLAUSIBLE[number]
    hits = [k for k in range(len(answer_ids(sol))) if old in answer_source(sol, k)]
    assert len(hits) == 1, f"exercise {number}: {old!r} is in answer cells {hits}, expected exactly one"
    return patched(sol, {hits[0]: answer_source(sol, hits[0]).replace(old, new)})


def visible_failure(graded, words: str) -> str | None:
    """None when a visible test of ``graded`` (a :class:`course_lib.grading.grade.Graded`) failed in
    the way ``course check`` also sees (an error in the cell, or a probe's verdict) with ``words``
    in its message; else what the visible tests said."""
    seen = []
    for r in graded.results:
        if r.test.hidden or r.status == "passed":
            continue
        learner_sees_it = r.status == "failed" or (r.status == "wrong" and "grader's own test" in r.message)
        if learner_sees_it and words in r.message:
            return None
        seen.append((r.test.id, r.status, r.message))
    return f"no visible failure naming {words!r}: {seen}"
