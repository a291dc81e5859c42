"""The benchmarks keep working: each runs at a tiny size on the tiny model (not a timing test)."""

from bench import packing


def test_the_packing_benchmark_runs_and_reports_its_figures(test_model_dir):
    figures = packing.main(["--rows", "6", "--repeats", "1", "--window", "4", "--model", str(test_model_dir)])
    assert figures["rows"] == 6
    assert figures["single_rows_per_s"] > 0 and figures["packed_length_aware_rows_per_s"] > 0
    assert figures["largest_logprob_difference"] < 1e-4  # float32: packed agrees with single
    assert figures["embeddings_min_cosine"] > 0.9999
