"""Exercise generation from solution sources: markers replaced, hidden tests removed, errors named."""
import pytest

from course_lib.kit.notebooks import (HIDDEN_PLACEHOLDER, NotebookSourceError, find_markers,
                                  make_exercise_source, to_notebook)

PARAMS = '# %% tags=["parameters"]\nSMOKE = False\n\n'


def test_solution_block_becomes_not_implemented_with_the_hint():
    src = PARAMS + ("# %%\ndef f(x):\n    ### BEGIN SOLUTION use x twice\n    return 2 * x\n"
                    "    ### END SOLUTION\n\n# %%\nprint(f(2))\n")
    out = make_exercise_source(src, "s.py")
    assert "return 2 * x" not in out
    assert "    # YOUR CODE HERE\n    raise NotImplementedError('use x twice')" in out
    assert "print(f(2))" in out and "SMOKE = False" in out


def test_hint_separator_is_optional_and_default_hint_exists():
    out = make_exercise_source("# %%\n### BEGIN SOLUTION: add them\nz = 1\n### END SOLUTION\n")
    assert "raise NotImplementedError('add them')" in out
    out = make_exercise_source("# %%\n### BEGIN SOLUTION\nz = 1\n### END SOLUTION\n")
    assert "raise NotImplementedError('write your solution here')" in out


def test_hidden_tests_are_removed_but_the_cell_stays():
    src = PARAMS + "# %%\nx = 1\n### BEGIN HIDDEN TESTS\nassert secret()\n### END HIDDEN TESTS\n"
    out = make_exercise_source(src)
    assert "secret" not in out and HIDDEN_PLACEHOLDER in out
    # same number of cells, so cell ids line up between solution and exercise
    assert len(to_notebook(out, "e").cells) == len(to_notebook(src, "s").cells)


@pytest.mark.parametrize("body, line, words", [
    ("# %%\n### BEGIN SOLUTION\nx = 1\n", 1, "never closed"),
    ("# %%\n### BEGIN SOLUTION\nx = 1\n# %%\ny = 2\n### END SOLUTION\n", 1, "never closed"),
    ("# %%\n### BEGIN SOLUTION\n### BEGIN HIDDEN TESTS\n### END HIDDEN TESTS\n### END SOLUTION\n", 2,
     "cannot nest"),
    ("# %%\n### BEGIN SOLUTION\n### BEGIN SOLUTION\n", 2, "cannot nest"),
    ("# %%\nx = 1\n### END SOLUTION\n", 2, "without a matching"),
    ("# %%\n### BEGIN HIDDEN TESTS\nx = 1\n### END SOLUTION\n", 3, "closes the '### BEGIN HIDDEN"),
    ("# %% [markdown]\n# ### BEGIN SOLUTION\n", 1, "markdown cell"),
    ("# %% [md]\n# text\n# ### END HIDDEN TESTS\n", 2, "markdown cell"),
])
def test_malformed_markers_name_file_and_line(body, line, words):
    with pytest.raises(NotebookSourceError) as info:
        make_exercise_source(body, "solutions/99_x.py")
    msg = str(info.value)
    assert words in msg
    # line numbers are 1-based lines of the source file; the first line is the cell header
    assert f"solutions/99_x.py:{line + 1}:" in msg


def test_writefile_magic_line_is_not_a_cell_header():
    src = "# %%\n# %%writefile f.py\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n"
    assert "raise NotImplementedError" in make_exercise_source(src)


def test_find_markers_reports_lines():
    assert find_markers("a\n### BEGIN SOLUTION\nb\n    ### END SOLUTION\n") == [2, 4]


@pytest.mark.parametrize("src, words", [
    ("# %%\nx = 1\n", "must be tagged parameters"),
    ('# %% tags=["parameters"]\nSMOKE = True\n', "SMOKE = False"),
    ("# %% [markdown]\n# only prose\n", "no code cell"),
])
def test_parameters_cell_is_required(src, words):
    with pytest.raises(NotebookSourceError, match=words):
        to_notebook(src, "labs/99_x.py")
