"""The kit's own tooling, not course material: what builds, runs and checks the notebooks, and what
tells a user whether this machine can run them.

| module | job |
| --- | --- |
| ``root`` | where the kit lives (labs, exercises, configs are read from there) |
| ``notebooks`` | ``course notebooks build/check``: jupytext sources -> ``.ipynb`` with stable cell ids |
| ``run_notebooks`` | headless execution with papermill (``course labs run``, the tests) |
| ``notebook_paths`` | keeps the maintainer's paths out of committed lab outputs |
| ``checks`` | ``check``, ``check_close``: the notebooks' checks, failing with a sentence |
| ``doctor``, ``catalog`` | ``course doctor``: what this machine and install can do; what each lab needs |
| ``course_map`` | the README's course map: each lab, its exercise, its recorded full-size time |
"""
