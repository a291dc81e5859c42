"""`auto` keeps what it timed for the next load on the same machine (inference_app/engine/timed_widths.py)."""

import json

import pytest
import torch

from inference_app.catalogue import model_source
from inference_app.engine import cpu, quantized, timed_widths
from inference_app.engine.loader import load_model
from tests.inference.test_quantized import with_file_values


def packed_in_auto(test_model_dir, cache, timings=None):
    model = with_file_values(load_model(model_source(str(test_model_dir)), weights="dense").model, cache)
    return model, quantized.pack(model, None, "auto", cache=cache, timings=timings)


def choices(model):
    return {name: (module.form, module.max_rows) for name, module in model.named_modules()
            if isinstance(module, quantized.PackedLinear)}


def test_a_second_load_reads_the_first_loads_timing_and_times_nothing(test_model_dir, tmp_path, monkeypatch):
    cache = tmp_path / "millm-blocks.safetensors"
    first_model, first = packed_in_auto(test_model_dir, cache)
    assert first.timed_before == 0 and "timed by an earlier load" not in first.describe()
    written = json.loads((tmp_path / timed_widths.FILE).read_text())
    shapes = {f"{kind} {out_features}x{in_features}": width for (kind, out_features, in_features), width in first.widths.items()}
    assert len(shapes) == 5 and [{name: width for name, (_, width) in entry.items()} for entry in written.values()] == [shapes]

    def timed_again(*args, **kwargs):
        raise AssertionError("a shape was timed again")

    monkeypatch.setattr(quantized, "_packed_width", timed_again)
    second_model, second = packed_in_auto(test_model_dir, cache)
    assert second.timed_before == 5 and "5 shapes' widths as timed by an earlier load" in second.describe()
    assert (second.widths, second.forms, second.packed) == (first.widths, first.forms, first.packed)
    assert choices(second_model) == choices(first_model)


@pytest.mark.parametrize("change", ["threads", "cpu"])
def test_another_thread_count_or_cpu_times_again_beside_the_first_entry(change, test_model_dir, tmp_path, monkeypatch):
    cache = tmp_path / "millm-blocks.safetensors"
    packed_in_auto(test_model_dir, cache)
    threads = torch.get_num_threads()
    if change == "threads":
        torch.set_num_threads(threads + 1)
    else:
        monkeypatch.setattr(cpu, "cpu_model", lambda: "another CPU")
    try:
        _, again = packed_in_auto(test_model_dir, cache)
    finally:
        torch.set_num_threads(threads)
    assert again.timed_before == 0
    assert len(json.loads((tmp_path / timed_widths.FILE).read_text())) == 2


def test_a_damaged_file_is_timed_again_and_rewritten(test_model_dir, tmp_path):
    cache = tmp_path / "millm-blocks.safetensors"
    (tmp_path / timed_widths.FILE).write_text("{not json")
    _, packing = packed_in_auto(test_model_dir, cache)
    assert packing.timed_before == 0 and len(json.loads((tmp_path / timed_widths.FILE).read_text())) == 1


def test_the_timings_file_is_beside_the_conversion_or_in_MILLM_TIMINGS_DIR(tmp_path):
    folder = tmp_path / "model-cache" / "4632b6a29e01"
    assert timed_widths.location(folder) == timed_widths.location(folder, "") == folder / timed_widths.FILE
    expected = tmp_path / "timings" / f"4632b6a29e01-{timed_widths.FILE}"
    assert timed_widths.location(folder, str(tmp_path / "timings")) == expected


def test_timings_kept_elsewhere_are_written_there_alone_and_named_when_read(test_model_dir, tmp_path):
    cache, timings = tmp_path / "millm-blocks.safetensors", tmp_path / "not-yet" / "timings.json"
    packed_in_auto(test_model_dir, cache, timings)
    assert json.loads(timings.read_text()) and not (tmp_path / timed_widths.FILE).exists()
    _, second = packed_in_auto(test_model_dir, cache, timings)
    assert second.timed_before == 5 and f"({timings}; delete it to time again)" in second.describe()
