"""Expert parallelism from scratch: an MoE layer's experts sharded over ranks, tokens moved to them
and back with ``torch.distributed.all_to_all_single``.

| module | job |
| --- | --- |
| ``group`` | ``make_ep_group(ep)``: the EP groups (ep consecutive ranks) and expert-DP groups; ``EPGroup`` |
| ``all_to_all`` | ``exchange`` / ``AllToAll``: variable-split all-to-all, differentiable, logged |
| ``permute`` | received rows regrouped by local expert and back |
| ``dispatch`` | ``AllToAllDispatcher``: counts first, then tokens, local experts, combine |
| ``shard`` | ``shard_experts``, ``sync_gradients``, ``reduce_expert_gradients``, ``gather_experts`` |
| ``wire`` | ``expected_bytes`` (the formula) and ``measured_bytes`` (what the run handed over) |
| ``sequence_split`` | MoE under sequence parallelism: each tp rank routes its tokens, statistics over tp |
| ``in_trainer`` | the trainer's ``parallel.ep`` with ``train.strategy`` "ddp", "ddp-scratch", "fsdp" (imported by the registry) |
| ``zero_in_trainer`` | ... with "zero1" / "zero2": ``ExpertShardedOptimizer``, expert state sharded over expert-DP |
| ``fsdp_scratch_in_trainer`` | ... with "fsdp-scratch": SimpleFSDP over the dense weights, expert slices whole, reduced over expert-DP |

    ep = make_ep_group(2)                       # every rank, after init_process_group
    dispatchers = shard_experts(model, ep)      # model: a TinyGPT with moe_experts set, same weights everywhere
    loss = model(x_local, y_local)[1]; loss.backward()
    sync_gradients(model, ep); optimizer.step()
"""
from course_lib.parallel.expert_parallel.all_to_all import AllToAll, exchange
from course_lib.parallel.expert_parallel.dispatch import AllToAllDispatcher, all_reduce_load
from course_lib.parallel.expert_parallel.group import EPGroup, make_ep_group
from course_lib.parallel.expert_parallel.permute import group_by_local_expert, ungroup
from course_lib.parallel.expert_parallel.shard import gather_experts, is_expert, shard_experts, sync_gradients
from course_lib.parallel.expert_parallel.wire import expected_bytes, measured_bytes

__all__ = ["AllToAll", "AllToAllDispatcher", "EPGroup", "all_reduce_load", "exchange", "expected_bytes",
           "gather_experts", "group_by_local_expert", "is_expert", "make_ep_group", "measured_bytes",
           "shard_experts", "sync_gradients", "ungroup"]
