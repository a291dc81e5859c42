"""The scheduling policy, one decision at a time (inference_app/engine/policy.py). The tests of
admission, the scheduler, the runner and the gateway check that each of them follows it."""

from types import SimpleNamespace

from inference_app.engine import policy


def test_an_interactive_waiter_stands_behind_earlier_interactive_ones_and_ahead_of_batch_rows():
    # Two chats and three batch rows wait: a new chat is third, a new batch row sixth.
    assert policy.place_in_line(2, 5, interactive=True) == 2
    assert policy.place_in_line(2, 5, interactive=False) == 5
    assert policy.place_in_line(0, 3, interactive=True) == 0
    assert policy.CLASSES_IN_ORDER == (True, False)  # the slot grants interactive work first


def test_a_batch_takes_every_seat_but_one_and_always_one():
    assert [policy.batch_seats(seats) for seats in (1, 2, 4, 16)] == [1, 1, 3, 15]


def test_batch_rows_pause_beside_chats_on_a_cpu_and_decode_beside_them_on_a_gpu():
    assert policy.lane_mode("auto", "cpu") == "pause"
    assert policy.lane_mode("auto", "cuda") == "decode"
    assert policy.lane_mode("decode", "cpu") == "decode"
    assert policy.lane_mode("pause", "cuda") == "pause"


def test_the_first_joiner_always_joins_the_rest_within_the_budget_and_the_room():
    assert policy.joins_this_step(0, prompt_tokens=5000, budget_left=512, room=4)  # longer than the budget
    assert not policy.joins_this_step(1, prompt_tokens=600, budget_left=512, room=4)
    assert policy.joins_this_step(1, prompt_tokens=512, budget_left=512, room=4)
    assert not policy.joins_this_step(4, prompt_tokens=1, budget_left=512, room=4)  # no room left
    assert not policy.joins_this_step(0, prompt_tokens=1, budget_left=512, room=0)


def test_background_work_gives_way_while_an_interactive_request_waits():
    assert policy.gives_way(1) and policy.gives_way(3)
    assert not policy.gives_way(0)


def test_ends_come_before_rows_and_older_batches_before_newer():
    assert policy.NEXT_BATCH_ORDER == ("runs_rows", "created_at", "id")
    assert str(policy.claimable_beside(None)) == "(AND: )"  # nothing led elsewhere: any batch
    beside = policy.claimable_beside("2026-01-01")
    assert ("runs_rows", 0) in beside.children and ("created_at__lt", "2026-01-01") in beside.children
    assert beside.connector == "OR"


def test_a_request_goes_to_the_replica_with_the_least_work_counting_this_processs_own():
    busy = SimpleNamespace(pk="a", queue_waiting=3, in_flight=1)
    quiet = SimpleNamespace(pk="b", queue_waiting=0, in_flight=1)
    idle = SimpleNamespace(pk="c", queue_waiting=0, in_flight=0)
    assert policy.least_busy([busy, quiet, idle], {"a": 0, "b": 0, "c": 0}) is idle
    assert policy.least_busy([busy, quiet, idle], {"a": 0, "b": 0, "c": 2}) is quiet


def test_the_pending_limit_is_the_seeds_with_one_seat_and_one_more_for_each_further_seat():
    assert policy.pending_limit(8, 1) == 8
    assert policy.pending_limit(8, 4) == 11
