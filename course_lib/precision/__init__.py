"""Number formats and precision for training: the dtype policies (fp32, bf16, fp16, fp8), the
format helpers lab 03 shows, and FP8 (formats, scaling recipes, an FP8 Linear, model conversion).

    policy.py      make_policy / PrecisionPolicy: autocast and loss scaling for a run
    formats.py     dtype ranges, rounding, what a cast does to a set of values
    fp8.py         the E4M3 and E5M2 formats, saturation versus overflow
    recipes.py     tensorwise, delayed, rowwise, blockwise (DeepSeek-V3) and MXFP8 scaling
    fp8_linear.py  the kit's FP8 Linear (three FP8 GEMMs) and convert_to_fp8
    fp8_model.py   the trainer's FP8 set-up: torchao's Float8Linear (production) or the kit's
    accumulate.py  what a GEMM accumulator with fewer bits does to a long dot product

Everything that was importable from ``course_lib.precision`` before it became a folder still is.
"""
from course_lib.precision.formats import (cast_report, dtype_ranges, flat_grads, format_dtype_table,  # noqa: F401
                                          log_uniform_values, loss_scaling_report, round_to, ulp)
from course_lib.precision.policy import POLICIES, PrecisionPolicy, make_policy  # noqa: F401
