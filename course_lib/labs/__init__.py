"""What only the notebooks need: one module per lab or exercise, named like the notebook.

The mechanism packages (``parallel/``, ``checkpoint/``, ``stability/``, ``estimate/``, ...) hold
what a user of the library imports in their own training script; this package holds the
scaffolding a notebook runs around them: rank functions (spawned ranks can only run importable
code), measurement launches, kill harnesses and the checks that grade a learner's code. Nothing
outside ``course_lib.labs`` and ``course_lib.grading`` imports from here (a test holds it).

================================  ======================================================
module                            used by
================================  ======================================================
``lab00_orientation``             lab 00, exercise 00 (collectives, timing, the ring checker), lab 10
``lab07_checkpoints``             lab 07, exercise 07 and its grader's probes (kill harness)
``lab08_data_parallel``           lab 08 (DDP rank functions, timelines, sync cost)
``lab09_zero_fsdp_deepspeed``     lab 09 (one measured step per strategy; trainer runs on the wire)
``lab10_tensor_parallel``         lab 10 (TP primitives, Megatron blocks, DTensor vs scratch)
``lab11_pipeline_parallel``       labs 11 and 12 (schedules, layouts, sharded dp under tp / cp)
``lab12_finding_bottleneck``      lab 12 (profiled trainer jobs and their breakdowns)
``lab14_capstone``                lab 14 (the trainer under torchrun, killed and signalled)
``lab15_context_parallel``        lab 15 (ring attention, cp activations, the trainer with cp, counted)
``lab16_experts``                 lab 16 (router training, capacity, expert parallelism on ranks, counted)
``exercise_harness``              exercises 08-11 and 14 (the learner's code on spawned ranks)
``exercise08_bucketed_ddp``       exercise 08's checks
``exercise09_zero1_optimizer``    exercise 09's checks
``exercise10_tp_linear``          exercise 10's checks
``exercise11_one_f_one_b``        exercise 11's checks (deadlock simulator, gloo run)
``exercise13_online_softmax``     exercise 13's partials, checks and one-process ring
``exercise14_expert_dispatch``    exercise 14's checks (helpers in one process, dispatch/combine on ranks)
``exercise15_fp8_blockwise``      exercise 15's checks of the 1 x 128 FP8 quantizer against the library's
``plots``                         every lab's shared matplotlib helpers (draw on a given Axes)
``plots_memory``                  lab 01's stacked memory bars
``widgets``                       lab 01's memory calculator (sliders in, bytes per rank out)
================================  ======================================================
"""
