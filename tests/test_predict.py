"""Prediction cells (course_lib.kit.predict): never fail, remind when left None, show the gap."""
from course_lib.kit.predict import prediction_gap, show_prediction


def test_a_prediction_left_none_shows_the_measurement_and_asks_for_it(capsys):
    assert show_prediction("bubble", None, 0.452, why="the formula counts idle slots only") is None
    out = capsys.readouterr().out
    assert "fill in your prediction above" in out and "0.452" in out and "idle slots" in out


def test_the_gap_is_relative_for_numbers_and_equality_for_the_rest(capsys):
    assert abs(show_prediction("bytes", 433_152, 453_120, unit="bytes") - (433_152 - 453_120) / 453_120) < 1e-12
    out = capsys.readouterr().out
    assert "your prediction 433,152 bytes, measured 453,120 bytes (-4% from the measurement)" in out
    assert show_prediction("split", [2, 2, 3, 1], [2, 2, 3, 1]) == 0.0
    assert "(the same)" in capsys.readouterr().out
    assert prediction_gap([2, 2, 2, 2], [2, 2, 3, 1]) == 1.0
    assert prediction_gap(1.0, 0) is None and prediction_gap(0, 0) == 0.0
    show_prediction("head", 4.5, 4.46)
    assert "spot on" in capsys.readouterr().out
