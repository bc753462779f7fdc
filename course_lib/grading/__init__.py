"""The autograder (``course grade``) and the learner's self-check (``course check``).

Test cells call :func:`record` on the values they check; under the grader those values travel to
the grader process and are compared there with the instructor's references (see
``docs/ARCHITECTURE.md``, section "Grading"). Importing this package is cheap (no torch).
"""
from course_lib.grading.record import grading_active, record

__all__ = ["record", "grading_active"]
