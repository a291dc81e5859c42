"""Shared fixtures: a tiny random model made by `createtestmodel`, loaded through the production
loader. No test mocks the model, the database or the engine."""

import os

import pytest
from django.conf import settings as django_settings

from tests.model_files import ROOT, SECOND_GGUF, TEST_MODEL_DIR, build_second_gguf, build_test_model  # noqa: F401

# The suite runs in float32, where every exactness promise holds (SPEC 7a; `auto` would pick
# bfloat16 on a CPU with native bfloat16): the processes it starts (end-to-end stacks, the
# bench) inherit the variable, and this process's settings, loaded before this file, follow it.
# Tests of bfloat16's own promises ask for it by name; MILLM_TEST_DTYPE runs the suite in another.
TEST_DTYPE = os.environ.get("MILLM_TEST_DTYPE", "float32")
os.environ["MILLM_DTYPE"] = TEST_DTYPE
django_settings.MILLM_DTYPE = TEST_DTYPE
# `auto`'s timings (timed_widths.py), made while the suite's other worker keeps both cores busy,
# are kept apart from the ones beside var/model-cache, which the suite shares with `make run`
# and the bench: a server never reads widths the suite timed.
TEST_TIMINGS = ROOT / "var" / "test-timings"
os.environ["MILLM_TIMINGS_DIR"] = str(TEST_TIMINGS)
django_settings.MILLM_TIMINGS_DIR = str(TEST_TIMINGS)


@pytest.fixture(scope="session")
def test_model_dir():
    return build_test_model()


@pytest.fixture(scope="session")
def resident(test_model_dir):
    """The tiny model as the engine holds it: loaded by the production loader."""
    from inference_app.catalogue import model_source
    from inference_app.engine.loader import load_model
    from inference_app.engine.runtime import ResidentModel

    return ResidentModel(load_model(model_source(str(test_model_dir))))


@pytest.fixture(scope="session")
def second_gguf():
    return build_second_gguf()


# The tests that start processes of their own (end-to-end stacks, the bench's smoke run) are one
# unit of xdist's work: they run one after another on one worker, in file order, as they would
# alone (kills, heartbeats and timing-sensitive waits see no second stack beside theirs, and a test
# that leans on the one before it in its module, as the replicas' and the second model's do, finds
# it done on the same stack). Every other module is a unit of its own, run whole and in order on
# whichever worker is free, mostly the second, beside the processes (`-n auto --maxprocesses 2`,
# pyproject). xdist's own `--dist loadgroup` cannot say this under pytest 9.2 (it rewrites a test
# id pytest no longer reads), so the scheduler is this one; it overrides `_split_scope`, as xdist's
# own loadfile and loadgroup schedulers do (pytest-xdist is pinned below 4).
PROCESS_DIRECTORIES = ("tests/e2e/", "tests/bench/")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ProcessesApart(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return "processes" if module.startswith(PROCESS_DIRECTORIES) else module

    return ProcessesApart(config, log)
