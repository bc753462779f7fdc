"""Write a plan's files: all text is built first, then each file goes to a temporary name in the
same folder and is renamed over the old one, so a crash never leaves a half-written file and a
folder that already holds other files keeps them (only the names in PLAN_FILES are replaced)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from course_lib.planner.checkpoint_plan import checkpoint_plan
from course_lib.planner.configs import deepspeed_json, deepspeed_supports, fsdp_settings, trainer_toml
from course_lib.planner.launch_budget import budget, launch_files
from course_lib.planner.megatron_job import megatron_args_text
from course_lib.planner.report import plan_markdown
from course_lib.planner.search import Plan
from course_lib.planner.torchtitan_job import torchtitan_model_py, torchtitan_toml, torchtitan_unsupported

#: Every file `course plan` may write (and the only ones it ever replaces).
PLAN_FILES = ("plan.md", "train.toml", "ds_config.json", "fsdp_settings.json", "budget.json",
              "launch_torchrun.sh", "launch_deepspeed.sh", "hostfile", "accelerate_config.yaml",
              "launch_accelerate.sh", "job.sbatch", "torchtitan.toml", "torchtitan_model.py",
              "megatron_args.txt")


def plan_files(plan: Plan, out_dir: str | Path, *, mirror: str = "", validate_ds: bool = True) -> dict[str, str]:
    """File name -> text for ``plan`` (pure: writes nothing). Nothing fits -> only plan.md."""
    out = str(out_dir).rstrip("/") or "."
    if plan.best is None:
        return {"plan.md": plan_markdown(plan, None, None, ["plan.md"])}
    spec, best = plan.spec, plan.best
    ck = checkpoint_plan(spec, best)
    toml_path = f"{out}/train.toml"
    train_out = f"runs/{spec.model_name}-{spec.gpus}gpu"
    files = {"megatron_args.txt": megatron_args_text(spec, best, ck, out)}  # the engines people run at scale
    if spec.moe is not None:
        # A mixture-of-experts plan is for the engines that train one at scale (Megatron-LM,
        # torchtitan): the kit's trainer files would describe its dense stand-in, so none are written.
        if not torchtitan_unsupported(spec, best):
            files["torchtitan.toml"] = torchtitan_toml(spec, best, ck, out)
            files["torchtitan_model.py"] = torchtitan_model_py(spec, best)
        files["budget.json"] = json.dumps(budget(spec, best, ck), indent=2) + "\n"
        files["plan.md"] = plan_markdown(plan, ck, json.loads(files["budget.json"]), sorted(files) + ["plan.md"], out,
                                         f"runs/{spec.model_name}-{spec.gpus}gpu")
        return files
    files.update({"train.toml": trainer_toml(spec, best, ck, mirror),
                  "fsdp_settings.json": json.dumps(fsdp_settings(spec, best), indent=2) + "\n"})
    if not torchtitan_unsupported(spec, best):  # else plan.md says why there is no torchtitan file
        files["torchtitan.toml"] = torchtitan_toml(spec, best, ck, out)
        files["torchtitan_model.py"] = torchtitan_model_py(spec, best)
    deepspeed_runs_it = deepspeed_supports(best)
    if deepspeed_runs_it:  # DeepSpeed runs data parallelism here; no script for a layout it cannot start
        files["ds_config.json"] = json.dumps(deepspeed_json(spec, best, validate=validate_ds), indent=2) + "\n"
    bud = budget(spec, best, ck)
    files["budget.json"] = json.dumps(bud, indent=2) + "\n"
    launch = launch_files(spec, best, toml_path, out, train_out)
    if not deepspeed_runs_it:
        del launch["launch_deepspeed.sh"], launch["hostfile"]
    files.update(launch)
    files["plan.md"] = plan_markdown(plan, ck, bud, sorted(files) + ["plan.md"], out, train_out)
    return files


def write_plan(plan: Plan, out_dir: str | Path, *, mirror: str = "", validate_ds: bool = True) -> list[Path]:
    """Build every file, then write each atomically (temp + rename) into ``out_dir``; returns paths."""
    files = plan_files(plan, out_dir, mirror=mirror, validate_ds=validate_ds)
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        assert name in PLAN_FILES, name
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.chmod(tmp, 0o755 if name.endswith((".sh", ".sbatch")) else 0o644)
            os.replace(tmp, folder / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        written.append(folder / name)
    for name in PLAN_FILES:  # a previous plan's file this plan has no counterpart for (nothing fits)
        if name not in files and (folder / name).is_file():
            (folder / name).unlink()
    return written
