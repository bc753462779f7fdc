"""The plans the engine-file tests hold to the engines' own code (tests/test_planner_engines.py,
tests/test_planner_megatron.py): the course's three scenarios, the planner's own choices for
Llama 3 (cp > 1 on two nodes; interleaved stages with cp on 512 GPUs), GPT-2, a 78-layer Llama 2
70B and Llama 2 13B (Megatron-FSDP), and chosen layouts for what the search may not pick: DDP,
ZeRO-3, even, interleaved, uneven-interleaved and two-stage uneven pipelines,
BLOOM's 5,6*10,5 on 48 nodes, GPT-2 with tp 2 (a vocabulary tp does not divide).

Work: 8 planner searches (about 3 s here) and 9 layouts evaluated, once per process.
"""
from __future__ import annotations

import dataclasses
import functools

from course_lib.estimate import ModelShape
from course_lib.planner import Layout, evaluate, make_spec, plan, write_plan
from course_lib.planner.exercise import SCENARIOS
from course_lib.planner.stages import balanced_counts

BLOOM = ModelShape(70, 14336, 112, 250880, 2048, tied_embeddings=True, learned_pos_emb=False, bias=True,
                   mlp="gelu", norm="layernorm")
SEVEN_B = dict(model="llama2-7b", gpu="a100-80gb", gpus=8, gpus_per_node=8, tokens="1T")
SEVENTY_B = dict(model="llama2-70b", gpu="a100-80gb", gpus=64, gpus_per_node=8, tokens=2e12)
SEARCHED = {
    "llama3-8b-2-nodes": dict(model="llama3-8b", gpu="h100-80gb", gpus=16, gpus_per_node=8, tokens="1T"),
    "llama3-70b-512": dict(model="llama3-70b", gpu="h100-80gb", gpus=512, gpus_per_node=8, tokens="15T"),
    "gpt2-xl": dict(model="gpt2-xl", gpu="a100-80gb", gpus=8, gpus_per_node=8, tokens="30B"),
    "llama2-70b-78-layers": dict(SEVENTY_B, shape_overrides={"n_layers": 78}),
    "llama2-13b-fsdp": dict(model="llama2-13b", gpu="a100-40gb", gpus=32, gpus_per_node=8, tokens="1T"),
}


@functools.lru_cache(maxsize=None)
def engine_cases() -> tuple:
    """(name, spec, candidate) for every plan above, each the layout its files describe."""
    out = [(name, p.spec, p.best) for name, p in
           ((n, plan(**kw)) for n, kw in list(SCENARIOS.items()) + list(SEARCHED.items()))]
    s7, s70 = make_spec(**SEVEN_B), make_spec(**SEVENTY_B)
    bloom = make_spec(gpu="a100-80gb", gpus=384, gpus_per_node=8, tokens="366B", global_batch_tokens=2048 * 2048,
                      shape_overrides={f.name: getattr(BLOOM, f.name) for f in dataclasses.fields(BLOOM)})
    gpt2 = make_spec(model="gpt2-small", gpu="a100-80gb", gpus=8, gpus_per_node=8, tokens="10B")
    m7 = s7.global_batch // 8
    chosen = {
        "7b-ddp": (s7, Layout(1, 1, 8, 1, 0, "none", 1, m7)),
        "7b-zero3-full": (s7, Layout(1, 1, 8, 1, 3, "full", 1, m7)),
        "70b-tp4-pp2": (s70, Layout(4, 2, 8, 1, 1, "selective", 1, 128)),
        "70b-pp4v2": (s70, Layout(8, 4, 2, 1, 1, "selective", 1, 512, 2)),
        "70b-pp4v3-uneven": (s70, Layout(8, 4, 2, 1, 1, "selective", 1, 512, 3,
                                         balanced_counts(s70.shape, 12, s70.seq))),
        "70b-pp2-39-41": (s70, Layout(8, 2, 4, 1, 1, "full", 1, 256, 1, (39, 41))),
        "bloom-5-6x10-5": (bloom, Layout(4, 12, 8, 1, 1, "full", 2, 128, 1, (5,) + (6,) * 10 + (5,))),
        "gpt2-small-tp2": (gpt2, Layout(2, 1, 4, 1, 1, "none", 4, gpt2.global_batch // 16)),
    }
    out += [(name, spec, evaluate(spec, lay)) for name, (spec, lay) in chosen.items()]
    return tuple(out)


def write_plans(root, jobs: dict) -> dict:
    """name -> (Plan, folder) for each of ``jobs`` ({name: make_spec keywords}), planned and written
    under ``root`` as `course plan --out` writes them (DeepSpeed's parser over ds_config.json is
    tests/test_planner.py's)."""
    out = {}
    for name, kw in jobs.items():
        p = plan(**kw)
        write_plan(p, root / name, validate_ds=False)
        out[name] = (p, root / name)
    return out
