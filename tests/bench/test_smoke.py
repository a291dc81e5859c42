"""The benchmarks keep working: every part runs at a tiny size on the tiny model, with real
processes, and reports its figures and goals (not a timing test: no figure is asserted fast).
The parts that start servers of their own run with `-m slow`."""

import json
import subprocess
import sys

import pytest
import torch

from bench import __main__ as suite
from bench import packing
from bench.common import first_difference
from bench.peers import WORK
from inference_app.engine.loader import pick_dtype

AUTO_DTYPE = str(pick_dtype(torch.device("cpu"), "auto")).removeprefix("torch.")


# The parts that start servers of their own (concurrency: two stacks and llama.cpp; replicas: two
# stacks; peers and prefix: stacks and llama.cpp) took two thirds of the quick run: they run with `-m slow`.
# The rest share one tiny stack (or none) and run in `make test`.
OWN_SERVERS = ["concurrency", "replicas", "peers", "prefix"]
SHARED = [part for part in suite.PARTS if part not in OWN_SERVERS]


def run_quick(parts):
    """`python -m bench --quick PART...`: every part's figures, each check beside its goal, and
    the table with a row per check and per part."""
    summary = suite.main(["--quick", *parts])
    assert list(summary["parts"]) == parts
    for part, figures in summary["parts"].items():
        assert figures["checks"], part
        for item in figures["checks"]:
            assert set(item) == {"figure", "value", "goal", "met"}, part
    table = suite.render(summary)
    for part, figures in summary["parts"].items():
        # Each row names its engine's mode: the tiny model has no quantized weights; the suite's
        # float32, except peers and prefix, which run `auto` themselves.
        dtype, weights = figures["mode"].split("/")
        assert weights == "none", (part, figures["mode"])
        assert dtype == ("float32" if part not in suite.AUTO_PARTS else AUTO_DTYPE), part
        assert f"| {suite.LABEL.get(part, part)} | `{figures['mode']}` |" in table, part
    checks = sum(len(f["checks"]) for f in summary["parts"].values())
    assert table.count("\n| ") == checks + 1 + 1 + len(parts)  # two headers, a row per check and per part
    assert json.loads((suite.RESULTS / "summary.json").read_text())["quick"] is True
    return summary


def test_every_part_on_the_shared_stack_runs_at_a_tiny_size_and_reports_each_figure_beside_its_goal(test_model_dir):
    summary = run_quick(SHARED)
    assert (suite.RESULTS / "packing.png").stat().st_size > 1000  # the chart, off the README in --quick
    memory = summary["parts"]["memory"]
    assert memory["uvicorn_growth_mb"] >= 0 and memory["engine_growth_mb"] >= 0
    generation = summary["parts"]["generation"]
    assert generation["rows"] == 4 and generation["serial_rows_per_s"] > 0
    assert generation["batched_refused"] is None  # this server decodes batch rows together
    # Rows shared decode steps. Not necessarily all four: each row reaches the scheduler from a
    # thread of its own, and one that arrives after the others have ended decodes alone and is
    # rightly marked `batched: false` (it failed once so, under the other worker's load).
    assert generation["rows_marked_batched"] >= 2
    # float32 and greedy: every batched row is the serial row, token for token (README, "Batched decoding").
    assert generation["same_text_rows"] == 4 and generation["first_differing_token"] == {}


@pytest.mark.slow
def test_the_parts_with_servers_of_their_own_run_at_a_tiny_size_and_report_each_figure_beside_its_goal(test_model_dir):
    summary = run_quick(OWN_SERVERS)
    concurrency = summary["parts"]["concurrency"]
    servers = ["miserver", "serial"] + (["llamacpp"] if concurrency["llamacpp_server"]["available"] else [])
    for server in servers:
        for level in ("2", "4"):
            assert concurrency[server][level]["answered"] == int(level), (server, level)
            assert concurrency[server][level]["completion_tokens"] > 0, (server, level)
    peers = summary["parts"]["peers"]
    reference = peers["medians"]["float32 (reference)"]
    assert set(reference) == set(WORK) and all(rate > 0 for rate in reference.values())
    if peers["llamacpp"]:  # every work but synchronous scoring (this server's own) on llama.cpp too
        assert set(peers["medians"]["llama.cpp"]) == set(WORK) - {"sync_scoring"}
        assert peers["quality"]["llama.cpp"]["rows"] == 8 and peers["quality"]["llama.cpp"]["greedy_rows"] == 4
    prefix = summary["parts"]["prefix"]
    for server in ["reuse off", "reuse on"] + (["llama.cpp"] if prefix["llamacpp"] else []):
        assert set(prefix["medians"][server]) == {"scoring_job", "generation_job", "third_turn_s"}, server
        assert all(value > 0 for value in prefix["medians"][server].values()), server
    # float32 on the tiny model: reuse changes no top token (the part's own exactness check).
    assert prefix["quality"]["float32"]["reuse"]["top_token_changed"] == 0


def test_a_float32_promise_is_judged_in_float32_only():
    from bench.common import exact_check

    assert exact_check("rows equal", "3 of 4", "all 4", False, "float32")["met"] is False
    unjudged = exact_check("rows equal", "3 of 4", "all 4", False, "bfloat16")
    assert unjudged["met"] is None and "not judged in bfloat16" in unjudged["goal"]
    summary = {"date": "d", "seconds": 60, "machine": {"cpu": "c", "cores": 2, "threads": 2, "memory_gb": 1, "os": "o",
                                                       "python": "3", "torch": "t"},
               "parts": {"generation": {"mode": "bfloat16/Q4_1+packed", "checks": [unjudged], "report": []}}}
    assert "| generation | `bfloat16/Q4_1+packed` | rows equal | 3 of 4 |" in suite.render(summary)
    assert suite.render(summary).count("| – |") == 1


def test_first_difference_is_the_first_differing_index_or_the_shorter_length():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], [4]) == 0


def test_packed_and_single_agree_in_the_packing_part(test_model_dir):
    figures = packing.main(["--rows", "6", "--repeats", "1", "--window", "4", "--model", str(test_model_dir)])
    assert figures["rows"] == 6
    assert figures["largest_logprob_difference"] < 1e-4  # float32: packed agrees with single
    assert figures["embeddings_min_cosine"] > 0.9999


def test_the_bench_measures_the_dtype_the_environment_sets_not_the_suites():
    """bench.common's tiny model comes from tests/model_files.py: importing conftest.py (as it
    once did) pinned float32 on every part of `make bench`."""
    import os

    env = {key: value for key, value in os.environ.items() if key != "MILLM_DTYPE"}
    script = ("from bench.common import setup_django, tiny_model; setup_django(); tiny_model(); "
              "from django.conf import settings; import os; print(settings.MILLM_DTYPE, os.environ.get('MILLM_DTYPE'))")
    shown = subprocess.run([sys.executable, "-c", script], env=env, cwd=suite.ROOT, capture_output=True, text=True, check=True)
    assert shown.stdout.split() == ["auto", "None"]


def test_a_part_that_fails_in_a_full_run_is_a_missed_row_and_the_run_goes_on(monkeypatch, test_model_dir):
    """A full run (not --quick) records a part that raised as a missed row and runs the rest:
    llama.cpp's server once dropped a connection in `prefix` and the run's whole table was lost."""
    def dropped(part, arguments):
        raise subprocess.CalledProcessError(1, [sys.executable, "-m", f"bench.{part}"])

    monkeypatch.setattr(suite, "in_fresh_process", dropped)
    summary = suite.main(["decoders", "grammar", "--no-readme"])
    assert list(summary["parts"]) == ["decoders", "grammar"]  # the second ran after the first failed
    for part in ("decoders", "grammar"):
        [check] = summary["parts"][part]["checks"]
        assert check["met"] is False and check["value"].startswith("failed (CalledProcessError: "), part
    assert "| decoders | " in suite.render(summary) and "**missed**" in suite.render(summary)
