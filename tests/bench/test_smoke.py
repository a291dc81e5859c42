"""The benchmarks keep working: every part runs at a tiny size on the tiny model, with real
processes, and reports its figures and goals (not a timing test: no figure is asserted fast).
The parts that start servers of their own run with `-m slow`."""

import json

import pytest

from bench import __main__ as suite
from bench import packing
from bench.common import first_difference
from bench.peers import WORK


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
    # float32 and greedy: every batched row is the serial row, token for token (README, "Batched decoding").
    assert generation["rows_marked_batched"] == 4
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
