"""`course plan`: which parallel layout to run, how to launch it, checkpoint it, and what it costs.

    from course_lib.planner import plan
    p = plan(model="llama2-70b", gpu="a100-80gb", gpus=64, gpus_per_node=8, tokens=2e12)
    p.best.layout, p.best.memory_total, p.best.tokens_per_s      # the winner
    p.runners_up(5)                                               # ranked, one row per idea
    score_layout(p.spec, "tp8,pp2,dp4,zero1")                     # a layout you name: fits? rank?
    write_plan(p, "runs/plan-70b")                                # TOML, JSON, scripts, plan.md

Modules: spec (validated inputs, PlanError naming flags) - hardware (GPU aliases, interconnect
table) - costs (memory and step time of one layout) - search (enumerate, rank, why each lost) -
stages (pipeline splits, virtual stages) - layout_score (--layout) - checkpoint_plan (Young/Daly) - configs (trainer TOML, DeepSpeed JSON, FSDP) - engines
(what the engine files share) - torchtitan_job (job config + model module) - megatron_job (arguments + command) - launch_budget
(scripts via course_lib.launchers, budget) - report (table, plan.md) - output (writing files) - cli.
"""
from course_lib.planner.checkpoint_plan import CheckpointPlan, checkpoint_plan, young_daly_interval_s
from course_lib.planner.costs import Candidate, Layout, evaluate
from course_lib.planner.layout_score import LayoutScore, parse_layout, score_layout
from course_lib.planner.output import PLAN_FILES, plan_files, write_plan
from course_lib.planner.search import Plan, search, why_lost, why_not_fit
from course_lib.planner.spec import JobSpec, PlanError, make_spec


def plan(**kwargs) -> Plan:
    """Validate the inputs (``make_spec``'s keywords) and search: the ranked Plan."""
    return search(make_spec(**kwargs))


__all__ = ["CheckpointPlan", "Candidate", "JobSpec", "Layout", "LayoutScore", "parse_layout", "score_layout", "PLAN_FILES", "Plan", "PlanError", "checkpoint_plan",
           "evaluate", "make_spec", "plan", "plan_files", "search", "why_lost", "why_not_fit", "write_plan",
           "young_daly_interval_s"]
