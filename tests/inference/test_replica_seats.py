"""Replica seats (SPEC 10c): ENGINE_MAX_REPLICAS engines of one model are active at once, one
advisory lock each; the next waits as a standby and takes the first seat a dead replica frees;
a replica whose seat is free is noticed as dead by the others at their next heartbeat."""

import hashlib

import pytest
from django.db import connection

from inference_app.catalogue import model_source
from inference_app.engine.presence import advisory_key
from inference_app.engine.worker import Worker
from inference_app.models import Engine, Lease
from millm_lib.ids import new_id
from tests.factories import EngineFactory, LeaseFactory
from tests.inference.test_worker import takes_the_lock_within


@pytest.fixture
def engines(test_model_dir):
    """`engines(n)`: n registered engines of one model; all unregistered after the test."""
    made = []

    def make(count):
        source = model_source(str(test_model_dir), "tiny-replicated")
        for _ in range(count):
            worker = Worker(source)
            worker.register()
            made.append(worker)
        return made[-count:]

    yield make
    for worker in made:
        worker.unregister()


def test_seat_zero_is_the_lock_there_was_before_replicas():
    before = int.from_bytes(hashlib.sha256(b"millm-engine:m").digest()[:8], "big", signed=True)
    assert advisory_key("m") == advisory_key("m", 0) == before
    assert len({advisory_key("m", seat) for seat in range(4)}) == 4


@pytest.mark.django_db(transaction=True)
def test_two_replicas_hold_seats_and_a_third_waits_then_takes_the_freed_seat(engines, settings):
    settings.ENGINE_MAX_REPLICAS = 2
    first, second, third = engines(3)
    assert first.try_become_active() and second.try_become_active()
    assert {first.presence.seat, second.presence.seat} == {0, 1}
    assert third.try_become_active() is False
    freed = second.presence.seat
    second.unregister()  # its lock's connection closes: the standby may take the seat
    assert takes_the_lock_within(third, seconds=10)
    assert third.presence.seat == freed


@pytest.mark.django_db(transaction=True)
def test_with_one_replica_a_second_engine_is_a_standby(engines, settings):
    settings.ENGINE_MAX_REPLICAS = 1
    first, second = engines(2)
    assert first.try_become_active() and not second.try_become_active()


def two_active_replicas(engines, settings):
    settings.ENGINE_MAX_REPLICAS = 2
    first, second = engines(2)
    for worker in (first, second):
        assert worker.try_become_active()
        worker.activate()
    return first, second


@pytest.mark.django_db(transaction=True)
def test_activating_a_second_seat_leaves_the_first_replica_active(engines, settings):
    two_active_replicas(engines, settings)
    assert Engine.objects.replicas("tiny-replicated").count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_replica_whose_seat_is_free_is_demoted_at_the_next_heartbeat_of_another(engines, settings):
    first, second = two_active_replicas(engines, settings)
    # Both alive: each sees the other's seat held (seat 0's key is negative as it happens, the
    # other positive: both are read back from pg_locks as they were taken).
    assert first.presence.notice_dead_replicas() == [] and second.presence.notice_dead_replicas() == []
    # The second's process dies: PostgreSQL ends its session, and so frees its seat's lock. Its
    # heartbeat still looks fresh for ENGINE_STALE_S.
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s, 5000)", [second.presence._lock_connection.info.backend_pid])
    second.presence._lock_connection = None
    assert first.presence.notice_dead_replicas() == [second.engine_id]
    assert Engine.objects.get(pk=second.engine_id).role == Engine.Role.STANDBY
    assert list(Engine.objects.replicas("tiny-replicated").values_list("pk", flat=True)) == [first.engine_id]


@pytest.mark.django_db
def test_a_replicas_restart_or_stop_keeps_the_models_leases_only_while_another_replica_serves_it():
    peer = EngineFactory(model_id="m", resident_model_id="m")
    restarted = LeaseFactory(model_id="m", engine_id=new_id("eng_"))  # taken through the replica that restarts
    Lease.objects.forget_on_restart("m", "eng_restarting")
    Lease.objects.end_unless_served("the engine stopped", "m", "eng_stopping")
    kept = Lease.objects.get(pk=restarted.pk)
    assert kept.live  # neither deleted by the restart nor ended by the stop: the peer serves the model
    Engine.objects.demote(Engine.objects.filter(pk=peer.pk))  # the last replica is gone
    Lease.objects.end_unless_served("the engine stopped", "m", "eng_stopping")
    assert not Lease.objects.get(pk=restarted.pk).live
    Lease.objects.forget_on_restart("m", "eng_restarting")
    assert not Lease.objects.filter(pk=restarted.pk).exists()
