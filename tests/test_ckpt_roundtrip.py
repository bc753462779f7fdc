"""``course ckpt`` round trips: a run trained on CPU ranks -> consolidate -> export-hf -> loaded by
``transformers.from_pretrained`` -> the same logits as the trainer's own weights at that step, for
fsdp x tp 2x2 (llama-tiny: RoPE, GQA, untied head), zero2 x pp 2x2 (tiny: GPT-2, tied head) and
DeepSpeed ZeRO-3 on 4 ranks (sharded DCP, composed full, DeepSpeed partitions: every format the
trainer writes). The reverse: an HF folder -> ``model.init_from`` -> the first step's loss equals
the HF model's loss on that batch. Bad input: exit 2, named, nothing written.

One 4-rank launch trains the three layouts (3 steps each; ~90 s on 2 shared cores, so ``-m slow``);
everything else runs in this process (the default tier).
The logits tolerance is the parity test's (tests/test_hf_parity.py: fp32, rounding only).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

import ckpt_rank_fns as fns  # noqa: E402
from course_lib import cli  # noqa: E402
from course_lib.ckpt.runs import CkptError  # noqa: E402
from course_lib.data import tasks as data_lib  # noqa: E402
from course_lib.model import ModelConfig, TinyGPT  # noqa: E402
from course_lib.model.hf_weights import hf_model  # noqa: E402
from course_lib.parallel import run_ranks  # noqa: E402
from course_lib.train import train  # noqa: E402
from course_lib.trainer import config as train_config  # noqa: E402
from layout_checks import rows, tiny_cfg  # noqa: E402
from test_hf_parity import LOGIT_ATOL  # noqa: E402

STEPS = 3
LAYOUTS = {  # name -> (HF class, --set overrides); 4 ranks each
    "fsdp-tp": ("LlamaForCausalLM", dict(train__strategy="fsdp", parallel__tp=2, model__preset="llama-tiny",
                                         checkpoint__save_every=1)),  # every step: --with-optimizer continues one
    "zero2-pp": ("GPT2LMHeadModel", dict(train__strategy="zero2", parallel__pp=2, train__grad_accum=2,
                                         checkpoint__save_every=1)),
    "deepspeed-z3": ("GPT2LMHeadModel", dict(train__strategy="deepspeed", parallel__zero_stage=3)),
}


def layout_cfg(**sets) -> dict:
    sets = {"train__max_steps": STEPS, "train__micro_batch": 4, **sets}
    sets.setdefault("schedule__warmup_steps", min(3, sets["train__max_steps"]))
    return tiny_cfg(sets.pop("train__grad_accum", 1), **sets)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_layouts")
    runs = [(layout_cfg(**sets), root / name) for name, (_, sets) in LAYOUTS.items()]
    weights = run_ranks(fns.train_many_weights, 4, runs, timeout=600)[0]
    return root, dict(zip(LAYOUTS, weights))


def _picked(root: Path, step: int, mcfg) -> tuple:
    """``full_weights``' arguments for the checkpoint ``course ckpt`` would take at ``step``."""
    from course_lib.ckpt.runs import pick

    found, decoded = pick(root, step)
    return found, mcfg, decoded


def ckpt(*argv) -> int:
    return cli.main(["ckpt", *map(str, argv)])


def batch(vocab: int, seed: int = 0, n: int = 3, t: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow  # one 4-rank launch of three trainer runs, DeepSpeed's start included: ~90 s on 2 cores
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trained_on_ranks_consolidated_exported_and_loaded_by_transformers(layouts, name, tmp_path, capsys):
    root, weights = layouts
    run, want = root / name, weights[name]
    assert ckpt("list", run) == 0
    listed = capsys.readouterr().out
    saved_by = {"fsdp-tp": "4 ranks, fsdp tp2", "zero2-pp": "rank 0 wrote, zero2 pp2", "deepspeed-z3": "4 ranks, ZeRO-3"}
    assert f"step_00000000{STEPS}" in listed and saved_by[name] in listed, listed
    assert f"--resume auto would load step_00000000{STEPS}" in listed

    assert ckpt("consolidate", run, "--out", tmp_path / "w.safetensors") == 0
    from safetensors.torch import load_file
    flat = load_file(str(tmp_path / "w.safetensors"))
    for k, v in want.items():  # the trainer's weights, bit for bit (tied head stored once)
        if k in flat:
            assert torch.equal(flat[k].float(), v), k
    assert json.loads((tmp_path / "w.json").read_text())["source"]["step"] == STEPS

    assert ckpt("export-hf", run, "--out", tmp_path / "hf") == 0
    hf_cls = getattr(transformers, LAYOUTS[name][0])
    hf = hf_cls.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(hf).__name__ == LAYOUTS[name][0]
    mcfg = train_config.build_model_config(json.loads((run / "config.json").read_text()))
    ours = TinyGPT(mcfg).eval()
    ours.load_state_dict(want)
    idx = batch(mcfg.vocab_size)
    with torch.no_grad():
        diff = (ours(idx)[0] - hf(input_ids=idx).logits).abs().max().item()
    assert diff <= LOGIT_ATOL, diff

    # the consolidated file exports to the same folder contents
    assert ckpt("export-hf", tmp_path / "w.safetensors", "--out", tmp_path / "hf2") == 0
    a, b = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # --with-optimizer: step STEPS - 1's weights and AdamW state, continued on one process, give step STEPS
    if name == "deepspeed-z3":  # ZeRO's flat partitions: refused, naming DeepSpeed's own converter
        assert ckpt("consolidate", run, "--with-optimizer", "--out", tmp_path / "o.safetensors") == 2
        assert "ds_to_universal" in capsys.readouterr().err and not (tmp_path / "o.safetensors").exists()
        return
    _continue_on_one_process(run, STEPS - 1, tmp_path, dp=2)


def _continue_on_one_process(run: Path, step: int, tmp_path: Path, dp: int) -> None:
    """``consolidate --with-optimizer`` at ``step``, loaded into a plain one-process TinyGPT + AdamW
    (torch's ``set_optimizer_state_dict``), one trainer step taken by hand on the run's global batch
    (every data-parallel rank's micro-batches, clipping as configured): the weights equal those the
    run saved at ``step + 1``. Wrong moments or a wrong step count would change every updated weight."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    from course_lib.ckpt.runs import checkpoint_root, full_weights, model_config, run_config
    from course_lib.schedules import make_scheduler, schedule_from_config
    from course_lib.trainer.startup import adamw

    out = tmp_path / "resume.safetensors"
    assert ckpt("consolidate", run, "--step", step, "--with-optimizer", "--out", out) == 0
    root = checkpoint_root(run)
    cfg = run_config(root)
    mcfg = model_config(cfg)
    model = TinyGPT(mcfg)
    weights = load_file(str(out))
    if mcfg.tie_embeddings:
        weights["lm_head.weight"] = weights["tok_emb.weight"]
    model.load_state_dict(weights)
    optimizer = adamw(cfg["optim"])(model)
    scheduler = make_scheduler(optimizer, schedule_from_config(cfg))  # adds initial_lr, as in the run
    saved = torch.load(out.with_suffix(".optim.pt"), weights_only=True)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=saved, options=StateDictOptions(full_state_dict=True))
    for _ in range(step):
        scheduler.step()
    ga = cfg["train"]["grad_accum"]
    streams = [data_lib.stream_from_config(cfg, dp_rank=r, dp_size=dp, device="cpu") for r in range(dp)]
    for s in streams:  # the batches the first `step` steps consumed
        for _ in range(step * ga):
            next(s)
    micro = [next(s) for s in streams for _ in range(ga)]
    for x, y in micro:  # every micro-batch has the same token count: the global mean is the mean of means
        (model(x, y)[1] / len(micro)).backward()
    if cfg["stability"]["max_grad_norm"]:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["stability"]["max_grad_norm"])
    optimizer.step()
    next_step = full_weights(*_picked(root, step + 1, mcfg))
    for k, v in model.state_dict().items():
        assert torch.allclose(v, next_step[k], rtol=1e-4, atol=1e-6), (k, (v - next_step[k]).abs().max().item())
    moved = full_weights(*_picked(root, step, mcfg))
    assert any(not torch.equal(moved[k], next_step[k]) for k in next_step), "the step changed no weight"


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A 'pretrained' Llama: transformers' own random init (not TinyGPT's), saved by save_pretrained."""
    folder = tmp_path_factory.mktemp("pretrained") / "llama"
    cfg = ModelConfig.preset("llama-tiny", vocab_size=64)
    torch.manual_seed(123)
    hf_model(cfg).save_pretrained(str(folder))
    return folder


def test_hf_folder_init_from_first_loss_equals_the_hf_models_loss(hf_folder, tmp_path):
    cfg = layout_cfg(train__max_steps=1, model__preset="llama-tiny", model__init_from=str(hf_folder))
    result = train(cfg, tmp_path / "run")
    first = rows(tmp_path / "run")[0]["loss"]
    x, y = next(data_lib.stream_from_config(cfg, dp_rank=0, dp_size=1, device="cpu"))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(hf_folder)).eval()
    with torch.no_grad():
        logits = hf(input_ids=x).logits
    hf_loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).item()
    assert result.steps == 1
    assert abs(first - hf_loss) <= 1e-5 * hf_loss, (first, hf_loss)


def test_init_from_that_does_not_fit_is_a_config_error_naming_both(hf_folder, tmp_path):
    with pytest.raises(train_config.ConfigError, match=r"model\.d_model = 32 vs 64 in the source"):
        layout_cfg(model__preset="llama-tiny", model__d_model=32, model__init_from=str(hf_folder))
    with pytest.raises(train_config.ConfigError, match=r"model\.norm = 'layernorm' vs 'rmsnorm'"):
        layout_cfg(model__init_from=str(hf_folder))  # the GPT-2 preset from a Llama folder
    # same config fields, a tensor of another shape: the file's and the model's shape both named
    bad = tmp_path / "bad"
    shutil.copytree(hf_folder, bad)
    from safetensors.torch import load_file, save_file
    st = load_file(str(bad / "model.safetensors"))
    st["model.norm.weight"] = torch.ones(65)
    save_file(st, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(train_config.ConfigError, match=r"model\.norm\.weight: .* \(65,\) vs model \(64,\)"):
        layout_cfg(model__preset="llama-tiny", model__init_from=str(bad))
    with pytest.raises(train_config.ConfigError, match="no such file"):
        layout_cfg(model__init_from=str(tmp_path / "nothing"))


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    train(layout_cfg(checkpoint__save_every=1), out)
    return out


def _nothing_left(folder: Path) -> None:
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".tmp-")]


def test_bad_input_is_named_exit_2_and_nothing_is_written(single_run, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ckpt("list", empty) == 2 and "no checkpoint" in capsys.readouterr().err
    assert ckpt("consolidate", single_run, "--step", 7, "--out", tmp_path / "a.safetensors") == 2
    assert "no checkpoint of step 7; steps saved: 1, 2, 3" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    assert ckpt("export-hf", single_run, "--out", tmp_path / "taken") == 2
    assert "exists; refusing" in capsys.readouterr().err
    # a corrupt checkpoint: flip a byte of its weights; named when asked for, passed over otherwise
    broken = tmp_path / "broken"
    shutil.copytree(single_run, broken)
    weights = broken / "checkpoints" / "step_000000003" / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0xFF
    weights.write_bytes(bytes(blob))
    assert ckpt("consolidate", broken, "--step", 3, "--out", tmp_path / "b.safetensors") == 2
    err = capsys.readouterr().err
    assert "step_000000003" in err and "checksum" in err
    assert ckpt("list", broken) == 1
    out = capsys.readouterr().out
    assert "NO: " in out and "would load step_000000002" in out and "passed over: step_000000003" in out
    # a TinyGPT no HF class expresses: refused naming the switch
    bounded = ModelConfig.preset("tiny", vocab_size=64, embedding_bound=2.0)
    from safetensors.torch import save_file
    from course_lib.model.init_source import CONFIG_KEY
    sd = {k: v for k, v in TinyGPT(bounded).state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(tmp_path / "bounded.safetensors"), metadata={CONFIG_KEY: json.dumps(bounded.to_dict())})
    assert ckpt("export-hf", tmp_path / "bounded.safetensors", "--out", tmp_path / "hf") == 2
    assert "model.embedding_bound" in capsys.readouterr().err
    for name in ("a.safetensors", "a.json", "b.safetensors", "b.json", "hf"):
        assert not (tmp_path / name).exists(), name
    _nothing_left(tmp_path)


def test_export_without_transformers_says_how_to_install(single_run, tmp_path, capsys, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    assert ckpt("export-hf", single_run, "--out", tmp_path / "hf") == 2
    assert "pip install 'transformers==5.24.0'" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_with_optimizer_continues_on_one_process_to_the_runs_next_checkpoint(single_run, tmp_path, capsys):
    _continue_on_one_process(single_run, 2, tmp_path, dp=1)
    assert ckpt("consolidate", tmp_path / "resume.safetensors", "--with-optimizer",
                "--out", tmp_path / "again.safetensors") == 2
    assert "weights file; give the run folder" in capsys.readouterr().err
    assert ckpt("consolidate", single_run, "--with-optimizer", "--out", tmp_path / "resume.safetensors") == 2
    assert "resume.safetensors exists" in capsys.readouterr().err


def test_a_consolidated_file_starts_a_run_with_its_weights(single_run, tmp_path):
    assert ckpt("consolidate", single_run, "--step", 2, "--out", tmp_path / "w.safetensors") == 0
    out = tmp_path / "tuned"
    result = train(layout_cfg(train__max_steps=1, model__init_from=str(tmp_path / "w.safetensors")), out)
    from course_lib.ckpt.runs import checkpoint_root, full_weights, model_config, run_config
    root = checkpoint_root(single_run)
    step2 = full_weights(*_picked(root, 2, model_config(run_config(root))))
    model = TinyGPT(model_config(run_config(root)))
    model.load_state_dict(step2)
    cfg = layout_cfg(train__max_steps=1)
    x, y = next(data_lib.stream_from_config(cfg, dp_rank=0, dp_size=1, device="cpu"))
    with torch.no_grad():
        want = model(x, y)[1].item()
    assert result.steps == 1 and abs(rows(out)[0]["loss"] - want) <= 1e-6 * want
    with pytest.raises(CkptError, match="drop --step"):
        from course_lib.ckpt.write import load_source
        load_source(tmp_path / "w.safetensors", 2)


def test_a_corrupt_newest_full_checkpoint_is_passed_over_with_its_reason(single_run, tmp_path, capsys):
    """``pick`` verifies a full checkpoint by the read that decodes it: a flipped byte in the newest
    one makes it fall back to the one before, and asking for that step names the checksum failure."""
    from course_lib.ckpt.runs import CkptError, checkpoint_root, find_all, pick

    run = tmp_path / "run"
    shutil.copytree(single_run, run)
    root = checkpoint_root(run)
    newest, older = find_all(root)[-1], find_all(root)[-2]
    victim = max((p for p in newest.path.iterdir() if p.suffix != ".json"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    found, decoded = pick(root, None)
    assert found.name == older.name and decoded is not None and decoded[0]
    with pytest.raises(CkptError, match=rf"{newest.name}: .*does not match its checksum"):
        pick(root, newest.step)
    assert ckpt("consolidate", run, "--step", newest.step, "--out", tmp_path / "w.safetensors") == 2
    assert "does not match its checksum" in capsys.readouterr().err and not (tmp_path / "w.safetensors").exists()
