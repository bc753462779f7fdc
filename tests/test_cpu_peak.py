"""The CPU peak MFU divides by (course_lib/trainer/cpu_peak.py): stamped once by ``course doctor
--measure-peak``, never lowered by a later (busier) measurement, read back for the run's dtype and
thread count, and preferred to a start-up measurement that a busy machine makes low. Every timing
here is faked: the tests hold the rules, not this machine's speed."""
import json

import pytest
import torch

from course_lib.kit import doctor
from course_lib.trainer import cpu_peak, startup
from course_lib.trainer.cpu_peak import Peak

GF = 1e9


@pytest.fixture
def stamp_file(tmp_path, monkeypatch):
    path = tmp_path / "peak.json"
    monkeypatch.setenv(cpu_peak.STAMP_ENV, str(path))
    return path


def fake_peaks(fp32_per_thread=50 * GF, bf16_per_thread=2 * GF):
    """A peak_fn that answers ``per_thread x torch's thread count`` for each dtype."""
    rates = {torch.float32: fp32_per_thread, torch.bfloat16: bf16_per_thread}
    return lambda dtype: rates[dtype] * torch.get_num_threads()


def test_thread_counts_double_up_to_every_core():
    assert cpu_peak.thread_counts(1) == [1]
    assert cpu_peak.thread_counts(2) == [1, 2]
    assert cpu_peak.thread_counts(6) == [1, 2, 4, 6]
    assert cpu_peak.thread_counts(8) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="cores"):
        cpu_peak.thread_counts(0)


def test_measure_times_each_dtype_on_each_thread_count_and_restores_threads():
    before = torch.get_num_threads()
    peaks = cpu_peak.measure(counts=[1, 2], peak_fn=fake_peaks())
    assert peaks == {"float32": {"1": 50 * GF, "2": 100 * GF}, "bfloat16": {"1": 2 * GF, "2": 4 * GF}}
    assert torch.get_num_threads() == before


def test_a_busier_measurement_never_lowers_the_stamp(stamp_file):
    cpu_peak.write_stamp({"float32": {"1": 50 * GF}}, stamp_file)
    stamp = cpu_peak.write_stamp({"float32": {"1": 20 * GF, "2": 90 * GF}}, stamp_file)  # busy at 1 thread
    assert stamp["peaks"]["float32"] == {"1": 50 * GF, "2": 90 * GF}
    again = cpu_peak.write_stamp({"float32": {"1": 60 * GF}}, stamp_file)  # a quieter moment raises it
    assert again["peaks"]["float32"]["1"] == 60 * GF
    assert json.loads(stamp_file.read_text())["peaks"]["float32"]["1"] == 60 * GF
    assert stamp["cpu"] == cpu_peak.cpu_identity()["cpu"] and "measured_at" in stamp


def test_a_stamp_from_another_machine_or_torch_is_not_used(stamp_file):
    assert cpu_peak.read_stamp(stamp_file)[0] is None and "no stamp" in cpu_peak.read_stamp(stamp_file)[1]
    cpu_peak.write_stamp({"float32": {"1": 50 * GF}}, stamp_file)
    assert cpu_peak.read_stamp(stamp_file)[0] is not None
    for field, value in (("torch", "1.0.0"), ("cores", 999), ("cpu", "another chip")):
        data = json.loads(stamp_file.read_text())
        data[field] = value
        stamp_file.with_name("other.json").write_text(json.dumps(data))
        stamp, why = cpu_peak.read_stamp(stamp_file.with_name("other.json"))
        assert stamp is None and field in why and repr(value) in why
    stamp_file.with_name("bad.json").write_text("{not json")
    assert "unreadable" in cpu_peak.read_stamp(stamp_file.with_name("bad.json"))[1]
    # an old stamp for another torch is replaced, not merged: its figures may not hold any more
    data = json.loads(stamp_file.read_text())
    data["torch"], data["peaks"]["float32"]["1"] = "1.0.0", 500 * GF
    stamp_file.write_text(json.dumps(data))
    assert cpu_peak.write_stamp({"float32": {"1": 40 * GF}}, stamp_file)["peaks"]["float32"]["1"] == 40 * GF


def test_unmeasured_thread_counts_scale_up_from_the_nearest_lower_one():
    stamp = {"cores": 6, "peaks": {"float32": {"1": 10.0, "2": 18.0, "4": 30.0, "6": 40.0}}}
    assert cpu_peak.peak_from_stamp(stamp, torch.float32, 2) == 18.0
    assert cpu_peak.peak_from_stamp(stamp, torch.float32, 3) == pytest.approx(27.0)  # 18 x 3/2: an upper bound
    assert cpu_peak.peak_from_stamp(stamp, torch.float32, 64) == 40.0  # threads beyond the cores add nothing
    assert cpu_peak.peak_from_stamp(stamp, torch.bfloat16, 2) is None
    with pytest.raises(ValueError, match="threads"):
        cpu_peak.peak_from_stamp(stamp, torch.float32, 0)


def test_emulated_bf16_is_bounded_by_the_fp32_units(stamp_file):
    """bf16 emulated at 2 GFLOP/s on a CPU whose fp32 units do 50: the ceiling of a bf16 run is 50
    (dividing by 2 printed "MFU would be 223%"); on a CPU with native bf16 the bf16 peak wins."""
    cpu_peak.write_stamp({"float32": {"1": 50 * GF}, "bfloat16": {"1": 2 * GF}}, stamp_file)
    flops, detail = cpu_peak.stamped_peak(torch.bfloat16, 1)
    assert flops == 50 * GF and "float32" in detail and "emulated" in detail
    cpu_peak.write_stamp({"bfloat16": {"1": 200 * GF}}, stamp_file)
    flops, detail = cpu_peak.stamped_peak(torch.bfloat16, 1)
    assert flops == 200 * GF and "emulated" not in detail
    assert cpu_peak.stamped_peak(torch.float32, 1)[0] == 50 * GF
    assert cpu_peak.cpu_peak_dtypes(torch.float32) == (torch.float32,)


def cfg(precision="fp32", peak=0.0):
    return {"train": {"peak_flops": peak, "precision": precision}}


def test_the_trainer_prefers_the_stamp_to_a_busy_start_up_measurement(stamp_file, monkeypatch):
    """A busy machine makes a start-up measurement low (here a tenth of the truth): with a stamp the
    peak, and so every MFU, does not move."""
    busy = []
    monkeypatch.setattr(startup, "_measured_cpu_peak", lambda dtype, threads: busy.append(dtype) or 5 * GF)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    cpu_peak.write_stamp({"float32": {"1": 50 * GF}, "bfloat16": {"1": 2 * GF}}, stamp_file)
    for precision in ("fp32", "bf16", "fp16"):
        peak = startup.peak_flops(cfg(precision), torch.device("cpu"))
        assert (peak.flops, peak.source) == (50 * GF, "stamp"), precision
        assert "course doctor --measure-peak" in peak.detail
    assert busy == []  # nothing was timed
    configured = startup.peak_flops(cfg(peak=7e12), torch.device("cpu"))
    assert (configured.flops, configured.source) == (7e12, "config")


def test_without_a_stamp_the_start_up_measurement_is_a_labelled_fallback(stamp_file, monkeypatch):
    rates = {torch.float32: 30 * GF, torch.bfloat16: 1 * GF}
    monkeypatch.setattr(startup, "_measured_cpu_peak", lambda dtype, threads: rates[dtype])
    peak = startup.peak_flops(cfg("bf16"), torch.device("cpu"))
    assert (peak.flops, peak.source) == (30 * GF, "start-up")  # the fp32 units bound emulated bf16 here too
    assert "fallback" in peak.detail and "course doctor --measure-peak" in peak.detail
    assert "no stamp" in peak.detail
    assert Peak.of(1e12) == Peak(1e12, "caller", "given by the caller") and Peak.of(peak) is peak
    assert "30.0 GFLOP/s" in peak.describe() and "fallback" in peak.describe()


def test_ranks_agree_on_the_highest_start_up_peak():
    from course_lib.parallel import run_ranks
    import rank_fns

    assert run_ranks(rank_fns.agreed_peak, 2) == [2.0, 2.0]


def test_doctor_reports_the_stamp_or_how_to_make_one(stamp_file):
    missing = doctor._mfu_peak()
    assert missing["stamped"] is False
    assert "course doctor --measure-peak" in doctor._format_peak(missing)[0]
    cores = cpu_peak.cpu_identity()["cores"]
    cpu_peak.write_stamp({"float32": {"1": 50 * GF, str(cores): 50 * GF * cores}, "bfloat16": {"1": 2 * GF}},
                         stamp_file)
    report = doctor._mfu_peak()
    assert report["stamped"] and report["gflops"]["fp32_1"] == 50.0
    line = doctor._format_peak({**report, "load_1min": 0.0})[0]
    assert "fp32 50.0 (1 thread)" in line and "busy" not in line
    busy = doctor._format_peak({**report, "load_1min": cores * 4.0})[0]
    assert "busy" in busy and "measure again" in busy
    assert doctor.busy_load(1.5, 2) and not doctor.busy_load(0.5, 2) and not doctor.busy_load(None, 2)


def test_doctor_measure_peak_flag_stamps(stamp_file, monkeypatch, capsys):
    from course_lib import cli

    monkeypatch.setattr(cpu_peak, "measure", lambda: {"float32": {"1": 42 * GF}})
    monkeypatch.setattr(doctor, "gather", lambda **kw: {"problems": []})
    monkeypatch.setattr(doctor, "format_report", lambda report: "report")
    args = cli.build_parser().parse_args(["doctor", "--measure-peak"])
    assert args.func(args) == 0
    assert json.loads(stamp_file.read_text())["peaks"]["float32"]["1"] == 42 * GF
    assert "measuring this CPU's matmul peak" in capsys.readouterr().out
