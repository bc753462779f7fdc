"""Pipeline-parallel bubble: the idle fraction of a synchronous pipeline schedule.

Source: Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM"), Sec. 2.2: with p stages and m micro-batches per batch, GPipe and 1F1B both
idle for (p - 1) forward+backward slots, so

    bubble time / ideal time = (p - 1) / m,

and the interleaved schedule with v model chunks per rank divides it by v: (p - 1) / (v m).
Some texts quote the bubble as a share of the *total* step time instead:
(p - 1) / (m + p - 1) (GPipe paper, Huang et al. 2019), resp. (p - 1) / (v m + p - 1). The two
differ a lot when m is small, so which one is meant is the `relative_to` argument.
GPipe and 1F1B have the same bubble; 1F1B's gain is memory (see activations.py).
"""

from __future__ import annotations

from course_lib.validate import check_choice, check_int

SCHEDULES = ("gpipe", "1f1b", "interleaved")
RELATIVE_TO = ("ideal", "total")


def bubble_fraction(pp: int, micro_batches: int, *, schedule: str = "1f1b", virtual_stages: int = 1,
                    relative_to: str = "ideal") -> float:
    """Pipeline bubble as a fraction (a ratio of times, no unit).

    `pp` stages, `micro_batches` per optimizer step; `schedule` "gpipe" | "1f1b" | "interleaved"
    (the latter with `virtual_stages` >= 2 model chunks per rank). `relative_to="ideal"` gives
    bubble / ideal time, (p-1)/(v m) (Narayanan et al. 2021, Sec. 2.2); "total" gives bubble /
    (ideal + bubble), (p-1)/(v m + p - 1), the share of the step spent idle (Huang et al. 2019).
    Assumes equal stages and equal forward/backward times per micro-batch at every stage.
    """
    check_int("pp", pp, 1)
    check_int("micro_batches", micro_batches, 1)
    check_choice("schedule", schedule, SCHEDULES)
    check_int("virtual_stages", virtual_stages, 1)
    check_choice("relative_to", relative_to, RELATIVE_TO)
    if schedule == "interleaved" and virtual_stages < 2:
        raise ValueError("virtual_stages must be >= 2 for schedule='interleaved' "
                         "(one model chunk per rank is schedule='1f1b')")
    if schedule != "interleaved" and virtual_stages != 1:
        raise ValueError(f"virtual_stages must be 1 for schedule={schedule!r}; use schedule='interleaved'")
    idle = pp - 1
    ideal = virtual_stages * micro_batches  # in units of one chunk's forward+backward slot
    return idle / ideal if relative_to == "ideal" else idle / (ideal + idle)
