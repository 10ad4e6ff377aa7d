"""Whom the fetcher asks for a batch: owners, backoff after a failed stream, forgetting."""
from dpex.client.router import Router
from dpex.proto import dispatcher_pb2 as dpb

A, B = "10.0.0.1:1", "10.0.0.2:1"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def owners(*spans, alive=2):
    return dpb.SyncConsumerResponse(workers_alive=alive, owners=[
        dpb.SplitOwner(first_seq=first, num_batches=n, worker_address=address) for first, n, address in spans])


def test_each_batch_goes_to_the_owner_of_its_split_and_new_owners_replace_old():
    router = Router()
    assert router.route(0) is None and router.workers_alive == -1
    router.update(owners((0, 4, A), (4, 4, B)))
    assert [router.route(s) for s in (0, 3, 4, 7, 8)] == [A, A, B, B, None]
    router.update(owners((4, 4, A), alive=1))
    assert [router.route(s) for s in (0, 4)] == [None, A] and router.workers_alive == 1


def test_a_failed_worker_is_not_asked_until_its_backoff_is_over():
    clock = Clock()
    router = Router(backoff_s=1.0, clock=clock)
    router.update(owners((0, 2, A), (2, 2, B)))
    assert router.stream_failed(A) == 1
    assert router.route(0) is None and router.route(2) == B
    clock.now += 0.999
    assert router.route(1) is None
    clock.now += 0.002
    assert router.route(1) == A
    assert router.stream_failed(A) == 2  # counted, for the warning every tenth


def test_forget_drops_only_that_workers_ownership():
    router = Router()
    router.update(owners((0, 2, A)))
    router.forget(0, B)
    assert router.route(0) == A
    router.forget(0, A)
    assert router.route(0) is None and router.route(1) == A


def test_a_stream_epoch_routes_by_stream():
    router = Router(num_streams=2)  # seq j*2+k: batch j of stream k
    router.update(owners((0, 0, A), (1, 0, B)))
    assert [router.route(s) for s in range(6)] == [A, B, A, B, A, B]
