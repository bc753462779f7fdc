"""Rank functions for tests/test_deepspeed_strategy.py (spawned ranks import them from here)."""

import torch


def train_digest(rank, world_size, cfg, out_dir, faults=(), resume=False):
    """One rank of a training run: what it did and a digest of its weights."""
    from rank_fns import param_digest
    from course_lib.train import train

    result = train(cfg, out_dir, faults=list(faults), resume=resume)
    return {"steps": result.steps, "resumed_from": result.resumed_from, "final_loss": result.final_loss,
            "skipped": result.skipped_steps, "digest": param_digest(result.model)}


def train_many(rank, world_size, runs):
    """Several training runs one after another in the same ranks (one process start for all):
    ``runs`` is a list of ``(cfg, out_dir, faults, resume)``; returns :func:`train_digest` of each."""
    return [train_digest(rank, world_size, cfg, out_dir, faults, resume) for cfg, out_dir, faults, resume in runs]


def _build(cfg, info):
    """A DeepSpeedStrategy set up the way the trainer does it (same seed: same initial weights)."""
    from course_lib.trainer import config as train_config
    from course_lib.model import TinyGPT
    from course_lib.parallel.registry import make_strategy

    o = cfg["optim"]
    torch.manual_seed(cfg["train"]["seed"])
    model = TinyGPT(train_config.build_model_config(cfg))
    strategy = make_strategy("deepspeed", info, torch.device("cpu"), cfg)
    strategy.setup(model, lambda m: torch.optim.AdamW(m.param_groups(o["weight_decay"]), lr=o["lr"],
                                                      betas=(o["beta1"], o["beta2"]), eps=o["eps"]))
    return strategy


def _batches(cfg, rank, world_size, steps):
    from course_lib.data import tasks as data_lib

    t, d = cfg["train"], cfg["data"]
    dataset = data_lib.make_dataset(d["task"], seq_len=d["seq_len"], seed=t["seed"], vocab_size=d["vocab_size"])
    stream = data_lib.BatchStream(dataset, t["micro_batch"], rank=rank, world_size=world_size, seed=t["seed"])
    return [[next(stream) for _ in range(t["grad_accum"])] for _ in range(steps)]


def _snapshot(strategy):
    """Copies of everything a step may change: this rank's parameters (full or partition) and
    DeepSpeed's optimizer state (fp32 master partitions, Adam moments, step counts)."""
    from course_lib.checkpoint.state import to_cpu_copy

    params = {n: p.detach().clone() for n, p in strategy.model.named_parameters()}
    fp32 = [t.detach().clone() for t in getattr(strategy.engine.optimizer, "single_partition_of_fp32_groups", [])]
    return params, fp32, to_cpu_copy(strategy.optimizer.state_dict())


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def skip_and_lr(rank, world_size, cfg, offload_cfg):
    """ZeRO-2 strategy-level checks: the LR the trainer's scheduler (and lr_factor) sets is the LR
    DeepSpeed's optimizer steps with; a skipped step changes nothing and the next step equals the
    one a run that never saw the skipped batch takes; offload steps with DeepSpeedCPUAdam."""
    from course_lib.parallel.ranks.launch import init_distributed
    from course_lib.precision import make_policy
    from course_lib.schedules import Schedule, make_scheduler
    from rank_fns import param_digest

    info = init_distributed(backend="gloo")
    policy = make_policy("fp32", "cpu")
    batches = _batches(cfg, rank, world_size, 4)
    out = {}

    def fb(strategy, bs, scale=1.0):
        return strategy.forward_backward(bs, autocast=policy.autocast, backward=policy.backward,
                                         on_loss=lambda loss: loss * scale)

    # ---- run A: scheduled LR, a cut, then a skipped step
    a = _build(cfg, info)
    o = cfg["optim"]
    scheduler = make_scheduler(a.optimizer, Schedule(o["lr"], 10, warmup_steps=4, kind="cosine", min_lr=o["min_lr"]))
    seen = []
    inner_step = a.optimizer.step

    def recording_step(*args, **kwargs):
        seen.append([g["lr"] for g in a.optimizer.param_groups])
        return inner_step(*args, **kwargs)
    a.optimizer.step = recording_step
    expected = []
    for step, factor in ((0, 1.0), (1, 0.25)):
        expected.append(scheduler.get_last_lr()[0] * factor)
        fb(a, batches[step])
        a.optimizer_step(policy, lr_factor=factor, found_inf=False)
        a.zero_grad()
        scheduler.step()
    out["lr_seen"] = sorted({round(lr, 15) for lrs in seen for lr in lrs})
    out["lr_expected"] = sorted({round(lr, 15) for lr in expected})
    out["lr_after_cut"] = [g["lr"] for g in a.optimizer.param_groups]
    out["lr_scheduled"] = scheduler.get_last_lr()
    out["grad_norm"] = a.grad_norm_after_step()
    del a.optimizer.step  # back to the (scheduler-wrapped) step
    before = _snapshot(a)
    fb(a, batches[2], scale=1000.0)  # a spike: large, finite gradients that must not leak
    a.skip_step(policy)
    a.zero_grad()
    out["skip_changed_nothing"] = _same(before, _snapshot(a))
    fb(a, batches[3])
    a.optimizer_step(policy, lr_factor=1.0, found_inf=False)
    a.zero_grad()
    out["digest_skipped"] = param_digest(a.model)

    # ---- run B: the same LRs, never sees batch 2
    b = _build(cfg, info)
    scheduler = make_scheduler(b.optimizer, Schedule(o["lr"], 10, warmup_steps=4, kind="cosine", min_lr=o["min_lr"]))
    for step, factor in ((0, 1.0), (1, 0.25), (3, 1.0)):
        fb(b, batches[step])
        b.optimizer_step(policy, lr_factor=factor, found_inf=False)
        b.zero_grad()
        scheduler.step()
    out["digest_clean"] = param_digest(b.model)

    # ---- offload: DeepSpeed's CPU Adam does the step, and a skip leaves no trace there either
    c = _build(offload_cfg, info)
    out["offload_optimizer"] = type(c.optimizer).__name__
    batches = _batches(offload_cfg, rank, world_size, 3)
    fb(c, batches[0])
    c.optimizer_step(policy)
    c.zero_grad()
    before = _snapshot(c)
    fb(c, batches[1], scale=1000.0)
    c.skip_step(policy)
    c.zero_grad()
    out["offload_skip_changed_nothing"] = _same(before, _snapshot(c))
    fb(c, batches[2])
    c.optimizer_step(policy)
    d = _build(offload_cfg, info)
    for step in (0, 2):
        fb(d, batches[step])
        d.optimizer_step(policy)
        d.zero_grad()
    out["offload_digests"] = [param_digest(c.model), param_digest(d.model)]
    return out


def resume_convert_fallback_many(rank, world_size, cfgs, root, cross=()):
    """:func:`resume_convert_fallback` for each ``{name: cfg}`` under ``root/name``, one start; then
    each ``(saved, resumed)`` of ``cross`` resumes a copy of ``saved``'s ``full`` run with
    ``cfgs[resumed]`` (another ZeRO stage), expecting CheckpointLoadError: its message under
    ``out["cross"][(saved, resumed)]`` (None if it resumed)."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    from course_lib.checkpoint import CheckpointLoadError

    out = {name: resume_convert_fallback(rank, world_size, cfg, str(Path(root) / name)) for name, cfg in cfgs.items()}
    out["cross"] = {}
    for saved, resumed in cross:
        folder = Path(root) / f"{saved}-as-{resumed}"
        if rank == 0:
            shutil.copytree(Path(root) / saved / "full", folder)
        dist.barrier()
        try:
            train_digest(rank, world_size, cfgs[resumed], str(folder), resume=True)
            out["cross"][(saved, resumed)] = None
        except CheckpointLoadError as exc:
            out["cross"][(saved, resumed)] = str(exc)
        dist.barrier()
    return out


def resume_convert_fallback(rank, world_size, cfg, root):
    """ZeRO checkpoints end to end, in one start of the ranks:

    * ``full``: 10 steps, checkpoints at 5 and 10;
    * ``resumed``: a copy of ``full`` cut back to step 5 (checkpoint and metrics), resumed to 10;
    * ``fallback``: a copy of ``full`` whose step-10 checkpoint has a truncated optimizer shard,
      resumed: rank 0 falls back to step 5, every rank loads it, the run ends where ``full`` did;
    * rank 0 converts ``full``'s last checkpoint with ``deepspeed_to_state_dict`` into a plain
      single-process TinyGPT and compares it with the trained weights."""
    import shutil
    import warnings
    from pathlib import Path

    import torch.distributed as dist

    from course_lib.trainer import config as train_config
    from course_lib.model import TinyGPT
    from course_lib.parallel.deepspeed.checkpoints import deepspeed_to_state_dict
    from rank_fns import param_digest

    root = Path(root)
    full = train_digest(rank, world_size, cfg, str(root / "full"))
    if rank == 0:
        for name in ("resumed", "fallback"):
            shutil.copytree(root / "full", root / name)
        shutil.rmtree(root / "resumed" / "checkpoints" / "step_000000010")
        metrics = root / "resumed" / "metrics.jsonl"
        metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:5]))
        shard = root / "fallback" / "checkpoints" / "step_000000010" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        shard.write_bytes(shard.read_bytes()[:1000])
    dist.barrier()
    resumed = train_digest(rank, world_size, cfg, str(root / "resumed"), resume=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = train_digest(rank, world_size, cfg, str(root / "fallback"), resume=True)
    out = {"full": full, "resumed": resumed, "fallback": fallback,
           "fallback_warnings": [str(w.message) for w in caught if "unusable" in str(w.message)]}
    if rank == 0:
        state = deepspeed_to_state_dict(root / "full" / "checkpoints" / "step_000000010")
        plain = TinyGPT(train_config.build_model_config(cfg))
        plain.load_state_dict(state, strict=True)
        out["converted_digest"] = param_digest(plain)
    dist.barrier()
    return out


def refusals(rank, world_size, cases, root):
    """Run each ``(name, cfg)`` or ``(name, cfg, faults)`` expecting a ConfigError; returns
    ``{name: (message or None, whether the run folder exists)}``."""
    from pathlib import Path

    import torch.distributed as dist

    from course_lib.train import train
    from course_lib.trainer.config import ConfigError

    out = {}
    for name, cfg, *faults in cases:
        folder = Path(root) / name
        message = None
        try:
            train(cfg, folder, faults=faults[0] if faults else ())
        except ConfigError as exc:
            message = str(exc)
        dist.barrier()
        out[name] = (message, folder.exists())
    return out


def start_with_op_folder(rank, world_size, ext_dir, cfg, out_dir):
    """The trainer's DeepSpeed start with ``TORCH_EXTENSIONS_DIR = ext_dir`` (a folder with a
    planted lock): the OpLockError message it ended with (None if it started) and the seconds it
    took. Give it a launch of its own: torch's loader remembers the folder an op was asked for, and
    a later load from the real folder in the same process would rebuild the op there."""
    import os
    import time

    os.environ["TORCH_EXTENSIONS_DIR"] = ext_dir
    from course_lib.parallel.deepspeed.op_locks import OpLockError
    from course_lib.train import train

    t0 = time.monotonic()
    try:
        train(cfg, out_dir)
        message = None
    except OpLockError as exc:
        message = str(exc)
    return {"message": message, "seconds": time.monotonic() - t0}


def expert_parallel(rank, world_size, runs, fresh, root, grad_cfg, refusal_cfg):
    """``parallel.ep = 2`` under DeepSpeed (course_lib/parallel/deepspeed/experts.py), one launch:

    * ``runs``: ``(cfg, out_dir)`` pairs trained into ``out_dir/full`` and resumed from the
      checkpoint before the last (ep_train_rank_fns.train_and_cross_resume: the one-process weights,
      expert biases, last micro-batch's dropped tokens and loads of every rank); ``fresh``: more
      pairs trained only (their entries follow under ``"first"``, ``"second"`` has ``runs``' only);
    * ``grads``: :func:`expert_gradients` of ``grad_cfg`` (ZeRO-0 fp32);
    * ``cross_ep``: ``runs[0]``'s full run copied without its newest checkpoint and resumed with
      ``refusal_cfg`` (another parallel.ep): the CheckpointLoadError message (None if it resumed)."""
    import model_parallel_rank_fns as mp_fns
    from ep_train_rank_fns import train_and_cross_resume
    from course_lib.checkpoint import CheckpointLoadError
    from course_lib.train import train

    out = train_and_cross_resume(rank, world_size, runs, ())
    out["first"] += train_and_cross_resume(rank, world_size, fresh, (), resume=False)["first"]
    out["grads"] = expert_gradients(rank, world_size, grad_cfg)
    dst = f"{root}/cross-ep"
    mp_fns.copy_without_newest(runs[0][1] + "/full", dst)
    try:
        train(refusal_cfg, dst, resume=True)
        out["cross_ep"] = None
    except CheckpointLoadError as exc:
        out["cross_ep"] = str(exc)
    return out


def expert_gradients(rank, world_size, cfg):
    """One step's gradients after DeepSpeed's engine reduced them (ZeRO-0 fp32 leaves them in
    ``p.grad``), against one process's gradient of the mean loss over the same global batch (every
    rank's micro-batches, gathered), computed on a full copy of the model in this rank: the largest
    absolute difference over the dense weights and over this rank's expert slices, the largest
    expert gradient (so a zero cannot pass), and whether the slices are DeepSpeed expert params."""
    import copy

    import torch.distributed as dist
    from deepspeed.moe.utils import is_moe_param

    from course_lib.model import TinyGPT
    from course_lib.parallel.expert_parallel.shard import is_expert
    from course_lib.parallel.ranks.launch import init_distributed
    from course_lib.parallel.registry import make_strategy
    from course_lib.precision import make_policy
    from course_lib.trainer import config as train_config

    info = init_distributed(backend="gloo")
    torch.manual_seed(cfg["train"]["seed"])
    full = TinyGPT(train_config.build_model_config(cfg))
    reference = copy.deepcopy(full)  # one process's model: the same weights, every expert
    o = cfg["optim"]
    strategy = make_strategy("deepspeed", info, torch.device("cpu"), cfg)  # ExpertParallelDeepSpeed (ep > 1)
    strategy.setup(full, lambda m: torch.optim.AdamW(m.param_groups(o["weight_decay"]), lr=o["lr"],
                                                     betas=(o["beta1"], o["beta2"]), eps=o["eps"]))
    mine = _batches(cfg, rank, world_size, 1)[0]
    policy = make_policy("fp32", "cpu")
    strategy.forward_backward(mine, autocast=policy.autocast, backward=policy.backward, on_loss=lambda x: x)
    every = [None] * world_size
    dist.all_gather_object(every, mine)
    batches = [b for rank_batches in every for b in rank_batches]
    for x, y in batches:  # one process: the mean of the micro-batch losses over the global batch
        (reference(x, y)[1] / len(batches)).backward()
    want = dict(reference.named_parameters())
    dense = expert = biggest = 0.0
    for name, p in strategy.model.named_parameters():
        ref = want[name].grad
        if is_expert(p):
            per = p.shape[0]
            ref = ref[strategy.ep.rank * per:(strategy.ep.rank + 1) * per]
            expert = max(expert, (p.grad - ref).abs().max().item())
            biggest = max(biggest, ref.abs().max().item())
        else:
            dense = max(dense, (p.grad - ref).abs().max().item())
    marked = all(is_moe_param(p) == is_expert(p) for p in strategy.model.parameters())
    return {"dense": dense, "expert": expert, "biggest_expert": biggest, "marked": marked,
            "has_moe_layers": bool(strategy.engine.has_moe_layers)}
