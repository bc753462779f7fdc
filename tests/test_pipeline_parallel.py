"""Pipeline parallelism from scratch (GPipe, 1F1B) against one process on the global batch.

2 and 4 gloo ranks, m = 1, 2, 4, 8 micro-batches. Tolerance: fp32 ``rtol=1e-5, atol=1e-6``
(micro-batches add the same numbers in another order than one pass over the global batch).
Timing-sensitive checks (measured bubble against the estimate) are marked ``slow``.
"""
import itertools

import pytest
import torch

import pp_rank_fns as fns
from course_lib.estimate.flops import model_flops_per_iteration
from course_lib.estimate.pipeline import bubble_fraction
from course_lib.estimate.shapes import ModelShape
from course_lib.model import ModelConfig
from course_lib.parallel import run_ranks
from course_lib.parallel.pipeline import (balanced_split, build_stage, compute_order, even_split,
                                          measure_bubble, resolve_balance, run_schedule, split_model,
                                          stage_actions, stage_costs, summarize_timeline)

pytestmark = pytest.mark.usefixtures("one_thread")
RTOL, ATOL = 1e-5, 1e-6
CASES = [(s, m) for s in fns.SCHEDULES for m in fns.MICRO]
CASE_IDS = [f"{s}-m{m}" for s, m in CASES]


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request):
    """Every exactness scenario on `world` ranks, in one launch: (world, per-rank results)."""
    return request.param, run_ranks(fns.everything, request.param, timeout=240, threads_per_rank=1,
                                    show_output=False)


@pytest.fixture(scope="module")
def ref():
    return fns.reference(fns.GPT)


def close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def merged(results, key, what):
    """{dense name: tensor} over all stages (each name lives on exactly one stage)."""
    out = {}
    for r in results:
        for name, t in r[key][what].items():
            assert name not in out, f"{name} on two stages"
            out[name] = t
    return out


def assert_matches(got, want, label):
    assert got.keys() == want.keys(), (label, sorted(set(got) ^ set(want)))
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    for name in want:
        assert close(got[name], want[name]), (label, name, (got[name] - want[name]).abs().max())
    return worst


# ------------------------------------------------------------------ exactness against one process
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_loss_and_every_gradient_equal_one_process(ranks, ref, case):
    world, results = ranks
    schedule, m = case
    grads = merged(results, case, "grads")
    worst = assert_matches(grads, ref["grads"], case)
    print(f"{world} ranks {schedule} m={m}: max |grad - dense grad| = {worst:.2e}")
    last = results[world - 1][case]
    assert torch.allclose(torch.tensor(last["losses"]), torch.tensor(ref["losses"]), rtol=RTOL)
    assert all(r[case]["losses"] == [None] * fns.STEPS for r in results[:-1])  # loss lives on the last stage
    if m > 1:  # the comparison can fail: summing micro-batch losses instead of averaging would
        assert not all(close(g * m, ref["grads"][n]) for n, g in grads.items())


@pytest.fixture(scope="module")
def ref_accumulated():
    """One fp32 process accumulating m micro-batches, per m (see pp_rank_fns' docstring for why)."""
    return {m: fns.reference(fns.GPT, micro_batches=m) for m in fns.MICRO}


@pytest.fixture(scope="module")
def ref64():
    return fns.reference(fns.GPT, dtype=torch.float64)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fp32_weights_after_adamw_steps_equal_one_process_accumulating_the_same_micro_batches(
        ranks, ref_accumulated, case):
    world, results = ranks
    want = ref_accumulated[case[1]]
    assert_matches(merged(results, case, "grads"), want["grads"], case)
    worst = assert_matches(merged(results, case, "params"), want["params"], case)
    print(f"{world} ranks {case}: fp32 max |weight - accumulating process| after {fns.STEPS} AdamW steps "
          f"= {worst:.2e}")
    # the two copies of the tied token table / LM head got the same update
    assert torch.equal(results[0][case]["params"]["tok_emb.weight"], results[-1][case]["params"]["lm_head.weight"])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fp64_weights_after_adamw_steps_equal_one_process_on_the_global_batch(ranks, ref64, case):
    world, results = ranks
    key = (*case, "fp64")
    assert_matches(merged(results, key, "grads"), ref64["grads"], key)
    worst = assert_matches(merged(results, key, "params"), ref64["params"], key)
    print(f"{world} ranks {case}: fp64 max |weight - one pass| after {fns.STEPS} AdamW steps = {worst:.2e}")
    assert results[0][key]["params"]["tok_emb.weight"].dtype == torch.float64


def test_llama_rope_gqa_untied_matches_one_process(ranks):
    world, results = ranks
    assert_matches(merged(results, "llama", "grads"), fns.reference(fns.LLAMA)["grads"], "llama grads")
    want = fns.reference(fns.LLAMA, micro_batches=4)  # the llama run uses m = 4
    assert_matches(merged(results, "llama", "params"), want["params"], "llama params")


def test_an_uneven_split_is_still_exact(ranks, ref):
    world, results = ranks
    assert [len(r["uneven"]["block_ids"]) for r in results] == ([1, 3] if world == 2 else [1, 1, 1, 1])
    assert_matches(merged(results, "uneven", "grads"), ref["grads"], "uneven")


def test_sabotage_skipping_the_tied_gradient_sync_is_caught(ranks, ref):
    """Without summing the two halves of the tied gradient, both copies are wrong (and only they)."""
    world, results = ranks
    grads = merged(results, "no_tied_sync", "grads")
    assert not close(grads["tok_emb.weight"], ref["grads"]["tok_emb.weight"])
    assert not close(grads["lm_head.weight"], ref["grads"]["lm_head.weight"])
    assert close(grads["tok_emb.weight"] + grads["lm_head.weight"], ref["grads"]["tok_emb.weight"])
    for name, g in grads.items():
        if name not in ("tok_emb.weight", "lm_head.weight"):
            assert close(g, ref["grads"][name]), name


def test_a_stage_on_the_wrong_rank_is_refused(ranks):
    world, results = ranks
    for r in range(world):
        assert "must run on rank" in results[r]["wrong_rank"]


# ------------------------------------------------------------------ memory in flight
@pytest.mark.parametrize("m", fns.MICRO)
def test_peak_micro_batches_in_flight_gpipe_m_1f1b_at_most_pp_minus_stage(ranks, m):
    world, results = ranks
    for s in range(world):
        gpipe, onef = results[s][("gpipe", m)]["first"], results[s][("1f1b", m)]["first"]
        assert gpipe["peak_in_flight"] == m
        assert onef["peak_in_flight"] == min(m, world - s)
        # bytes autograd saved: per micro-batch the same in both schedules, so the peaks scale with
        # the counts
        assert gpipe["peak_activation_bytes"] > 0
        assert onef["peak_activation_bytes"] * m == gpipe["peak_activation_bytes"] * min(m, world - s)
    print(f"{world} ranks m={m}: in flight gpipe {[results[s][('gpipe', m)]['first']['peak_in_flight'] for s in range(world)]}"
          f", 1f1b {[results[s][('1f1b', m)]['first']['peak_in_flight'] for s in range(world)]}; bytes gpipe "
          f"{[results[s][('gpipe', m)]['first']['peak_activation_bytes'] for s in range(world)]}, 1f1b "
          f"{[results[s][('1f1b', m)]['first']['peak_activation_bytes'] for s in range(world)]}")


# ------------------------------------------------------------------ the schedule itself
def F(*ids):
    return [("forward", i) for i in ids]


def B(*ids):
    return [("backward", i) for i in ids]


def test_op_order_of_known_cases():
    # GPipe: all forwards, then all backwards, on every stage
    assert compute_order("gpipe", 4, 3, 2) == F(0, 1, 2) + B(0, 1, 2)
    # 1F1B, pp=4, m=8: stage 0 warms up with 3 forwards, stage 3 alternates from the start
    assert compute_order("1f1b", 4, 8, 0) == (F(0, 1, 2) + F(3) + B(0) + F(4) + B(1) + F(5) + B(2)
                                              + F(6) + B(3) + F(7) + B(4) + B(5, 6, 7))
    assert compute_order("1f1b", 4, 8, 2) == F(0) + sum((F(i + 1) + B(i) for i in range(7)), []) + B(7)
    assert compute_order("1f1b", 4, 8, 3) == sum((F(i) + B(i) for i in range(8)), [])
    assert compute_order("1f1b", 4, 2, 0) == F(0, 1) + B(0, 1)  # fewer micro-batches than stages
    # with the communication: pp=2, m=2
    assert stage_actions("1f1b", 2, 2, 0) == [
        ("forward", 0), ("send_activation", 0), ("forward", 1), ("send_activation", 1),
        ("recv_grad", 0), ("backward", 0), ("recv_grad", 1), ("backward", 1)]
    assert stage_actions("1f1b", 2, 2, 1) == [
        ("recv_activation", 0), ("forward", 0), ("backward", 0), ("send_grad", 0),
        ("recv_activation", 1), ("forward", 1), ("backward", 1), ("send_grad", 1)]
    for schedule, pp, m in itertools.product(("gpipe", "1f1b"), (1, 2, 3, 4), (1, 2, 5, 8)):
        for s in range(pp):  # each micro-batch once forward, once backward, forward first
            ops = compute_order(schedule, pp, m, s)
            assert sorted(ops) == sorted(F(*range(m)) + B(*range(m)))
            assert all(ops.index(("forward", i)) < ops.index(("backward", i)) for i in range(m))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_the_run_executes_exactly_the_schedule_and_its_clock_is_causal(ranks, case):
    world, results = ranks
    firsts = [results[s][case]["first"] for s in range(world)]
    for s, f in enumerate(firsts):
        assert [tuple(op) for op in f["ops"]] == stage_actions(*case[:1], world, case[1], s)

    def at(s, op, i, edge):
        e = next(e for e in firsts[s]["events"] if e["op"] == op and e["mb"] == i)
        return firsts[s]["origin"] + e[edge]

    for s in range(1, world):  # data flows: a stage computes only after its neighbour produced
        for i in range(case[1]):
            assert at(s, "forward", i, "start") >= at(s - 1, "forward", i, "end")
            assert at(s - 1, "backward", i, "start") >= at(s, "backward", i, "end")
    summary = summarize_timeline(firsts[0])
    assert summary["compute_s"] > 0 and summary["span_s"] >= summary["compute_s"]
    got = measure_bubble(firsts)
    assert got["estimated"] == bubble_fraction(world, case[1], schedule=case[0])
    assert got["measured"] > 0


# ------------------------------------------------------------------ stages (single process)
def test_stages_in_a_row_are_the_dense_model_under_the_same_names():
    for cfg in (fns.GPT, fns.LLAMA):
        model = fns.make_model(cfg)
        x, y = fns.batches(1)[0]
        _, want = model(x, y)
        dense = dict(model.named_parameters(remove_duplicate=False))
        for pp in (1, 2, 3, 4):
            stages = split_model(model, pp)
            h = x
            for st in stages[:-1]:
                h = st(h)
            assert torch.equal(stages[-1](h, y), want)
            names = [n for st in stages for n, _ in st.named_parameters()]
            assert len(names) == len(set(names))
            for st in stages:
                for n, p in st.named_parameters():
                    assert p is dense[n], n  # shared, not copied, under the dense name
            expected = set(dense) if pp > 1 or not cfg.tie_embeddings else set(dict(model.named_parameters()))
            assert set(names) == expected
            assert [len(st.block_ids) for st in stages] == even_split(cfg.n_layers, pp)
            assert stages[0].is_first and stages[-1].is_last
    assert split_model(fns.make_model(fns.GPT), 2)[0].tied  # tied copy on the first stage


def test_even_and_explicit_balance():
    assert even_split(4, 4) == [1, 1, 1, 1]
    assert even_split(7, 3) == [3, 2, 2]
    cfg = fns.GPT
    assert resolve_balance(cfg, 2, [1, 3]) == [1, 3]
    assert resolve_balance(cfg, 2, None) == [2, 2]
    stage = build_stage(fns.make_model(cfg), 1, 2, [1, 3])
    assert stage.block_ids == [1, 2, 3]
    assert {n.split(".")[1] for n, _ in stage.named_parameters() if n.startswith("blocks.")} == {"1", "2", "3"}


def test_balanced_split_gives_the_head_stage_fewer_blocks():
    gpt2 = ModelConfig.preset("gpt2-small")  # head 2 s h V ~ 4.5 blocks at s = 1024
    assert even_split(12, 4) == [3, 3, 3, 3]
    assert balanced_split(gpt2, 4) == [3, 4, 4, 1]  # ties: earlier stages fewer blocks (1F1B memory)
    assert max(stage_costs(gpt2, 4, "balanced")) < max(stage_costs(gpt2, 4))
    assert balanced_split(fns.HEAVY_HEAD, 2) == [4, 2]
    costs = stage_costs(fns.HEAVY_HEAD, 2, "balanced")
    assert costs[0] == costs[1]  # 4 blocks = 2 blocks + the head


@pytest.mark.parametrize("vocab,n_layers,pp", [(64, 5, 2), (2000, 6, 3), (8000, 7, 4), (300, 8, 4), (64, 3, 3)])
def test_balanced_split_is_optimal_by_brute_force(vocab, n_layers, pp):
    cfg = ModelConfig(vocab_size=vocab, block_size=16, n_layers=n_layers, n_heads=4, d_model=32)
    comps = [list(c) for c in itertools.product(range(1, n_layers + 1), repeat=pp) if sum(c) == n_layers]
    best_max = min(max(stage_costs(cfg, pp, c)) for c in comps)
    got = stage_costs(cfg, pp, balanced_split(cfg, pp))
    assert max(got) == best_max
    assert sum(c * c for c in got) == min(sum(c * c for c in stage_costs(cfg, pp, c)) for c in comps
                                          if max(stage_costs(cfg, pp, c)) == best_max)


def test_stage_costs_add_up_to_the_flop_estimator():
    for cfg in (ModelConfig.preset("gpt2-small"), ModelConfig.preset("llama2-7b"), fns.HEAVY_HEAD):
        shape = ModelShape(n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
                           vocab_size=cfg.vocab_size, seq_len=cfg.block_size, d_ff=cfg.d_ff,
                           n_kv_heads=cfg.n_kv_heads, mlp=cfg.mlp, norm=cfg.norm)
        # the estimator counts forward + backward = 3 x forward
        assert 3 * sum(stage_costs(cfg, 2)) == model_flops_per_iteration(shape, batch=1)


# ------------------------------------------------------------------ bad input
def test_bad_input_errors():
    model = fns.make_model(fns.GPT)  # 4 blocks
    with pytest.raises(ValueError, match=r"pp must be in \[1, n_layers=4\]"):
        build_stage(model, 0, 5)
    with pytest.raises(ValueError, match="balance must sum to n_layers=4"):
        build_stage(model, 0, 2, [1, 2])
    with pytest.raises(ValueError, match=r"balance must have one entry per stage \(pp=2\)"):
        build_stage(model, 0, 2, [1, 1, 2])
    with pytest.raises(ValueError, match=r"balance\[0\] must be in \[1"):
        build_stage(model, 0, 2, [0, 4])
    with pytest.raises(TypeError, match=r"balance\[1\] must be an int"):
        build_stage(model, 0, 2, [2, 2.0])
    with pytest.raises(ValueError, match="'balanced'"):
        build_stage(model, 0, 2, "greedy")
    with pytest.raises(ValueError, match=r"stage must be in \[0, pp - 1=1\]"):
        build_stage(model, 2, 2)
    with pytest.raises(TypeError, match="TinyGPT"):
        build_stage(torch.nn.Linear(2, 2), 0, 1)
    with pytest.raises(ValueError, match="schedule must be one of 'gpipe', '1f1b'"):
        compute_order("interleaved", 2, 2, 0)
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        compute_order("1f1b", 2, 0, 0)
    stage = build_stage(model, 0, 1)
    x, y = fns.batches(1)[0]  # 8 sequences
    with pytest.raises(ValueError, match=r"micro_batches \(3\) must divide the batch size \(8\)"):
        run_schedule(stage, x, y, micro_batches=3)
    with pytest.raises(ValueError, match="targets shape"):
        run_schedule(stage, x, y[:, :4])
    with pytest.raises(ValueError, match=r"simulate_s\[1\] must be >= 0"):
        run_schedule(stage, x, y, simulate_s=(0.0, -1.0))
    with pytest.raises(TypeError, match=r"simulate_s must be None or \(forward seconds"):
        run_schedule(stage, x, y, simulate_s=0.1)
    with pytest.raises(RuntimeError, match="process group"):
        run_schedule(stage, x, y)
    with pytest.raises(ValueError, match="hidden state"):
        build_stage(model, 1, 2)(torch.zeros(2, 3, 5))
    with pytest.raises(TypeError, match="cfg must be a ModelConfig"):
        stage_costs("gpt2", 2)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        balanced_split(fns.GPT, 2, seq_len=0)
    with pytest.raises(ValueError, match="results must"):
        measure_bubble([])
    with pytest.raises(ValueError, match="relative_to"):
        measure_bubble([{}], relative_to="busiest")


# ------------------------------------------------------------------ measured bubble (timing)
FWD_S, BWD_S = 0.03, 0.06  # simulated compute per micro-batch: >> the tiny model's real compute


@pytest.mark.slow
@pytest.mark.exclusive
@pytest.mark.parametrize("world", [2, 4])
def test_measured_bubble_matches_the_estimate_with_fixed_compute_time(world):
    results = run_ranks(fns.bubble_runs, world, FWD_S, BWD_S, timeout=240, threads_per_rank=1,
                        show_output=False)
    for case in CASES:
        timelines = [results[s][case] for s in range(world)]
        for relative_to in ("ideal", "total"):
            got = measure_bubble(timelines, relative_to=relative_to)
            print(f"{world} ranks {case} {relative_to}: measured {got['measured']:.3f} "
                  f"estimated {got['estimated']:.3f} span {got['span_s']:.3f} s")
            # Python overhead and message latency between ops count as idle: measured runs a
            # little above the estimate (by ~0.02-0.05 with a 30 ms forward)
            assert got["measured"] == pytest.approx(got["estimated"], rel=0.15, abs=0.05), (case, got)


@pytest.mark.slow
@pytest.mark.exclusive
def test_a_heavy_head_makes_the_even_split_idle_and_balancing_fixes_it():
    m = 8
    results = run_ranks(fns.imbalance_runs, 2, fns.HEAVY_HEAD, 0.02 / 425_984, m, timeout=240,
                        threads_per_rank=1, show_output=False)  # 20 ms per block forward
    even = measure_bubble([results[s]["even"] for s in range(2)])
    bal = measure_bubble([results[s]["balanced"] for s in range(2)])
    print(f"even {results[0]['even']['balance']}: bubble {even['measured']:.3f} span {even['span_s']:.3f} s; "
          f"balanced {results[0]['balanced']['balance']}: bubble {bal['measured']:.3f} span {bal['span_s']:.3f} s; "
          f"estimate {bal['estimated']:.3f}")
    assert results[0]["even"]["balance"] == [3, 3] and results[0]["balanced"]["balance"] == [4, 2]
    # Units of one block's forward (20 ms), backward = 2 x forward, m = 8. Even [3, 3] costs 3 : 5:
    # stage 1 sets the pace, span ~ 3 + 8 x 15 + 6 = 129, busy 72 + 120, bubble (258 - 192) / 192
    # ~ 0.34. Balanced [4, 2] costs 4 : 4: span ~ 9 x 12 = 108, bubble (216 - 192) / 192 = 0.125.
    assert bal["measured"] == pytest.approx(bal["estimated"], rel=0.2, abs=0.05)
    assert even["measured"] > bal["measured"] + 0.1
    assert even["span_s"] > bal["span_s"] * 1.1
