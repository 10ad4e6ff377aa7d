"""dpex.client.lanes: which job an iter() runs on."""
from dpex.client.lanes import Lane, Lanes


class Epoch:
    def __init__(self):
        self.closed, self.why = False, None

    def close(self, why=None):
        self.closed, self.why = True, why


class Streams:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


def lane(job_id, released):
    return Lane(job_id, b"key", Streams(), lambda: released.append(job_id))


def test_an_iter_while_an_epoch_is_read_opens_a_lane_and_free_lanes_are_reused():
    released = []
    lanes = Lanes(lane(1, released))
    opened = iter(range(2, 10))
    open_lane = lambda: lane(next(opened), released)  # noqa: E731
    first = Epoch()
    assert lanes.pick(open_lane) is lanes.first
    lanes.first.start(first)
    second_lane = lanes.pick(open_lane)  # lane 0 busy: another job
    assert second_lane.job_id == 2
    second = Epoch()
    second_lane.start(second)
    assert lanes.pick(open_lane).job_id == 3  # both busy
    first.close()  # finished or left: lane 0 is free again
    assert lanes.pick(open_lane) is lanes.first
    del second  # an iterator dropped frees its lane too
    assert lanes.pick(lambda: None, first_only=False) is lanes.first
    assert released == []


def test_a_resumed_epoch_runs_on_lane_0_and_a_new_definition_retires_the_old_lanes():
    released = []
    lanes = Lanes(lane(1, released))
    reading = Epoch()
    lanes.first.start(reading)
    assert lanes.pick(lambda: lane(2, released), first_only=True) is lanes.first  # the caller ends its epoch
    extra = lanes.pick(lambda: lane(2, released))
    busy = Epoch()
    extra.start(busy)
    old_first = lanes.first
    lanes.renew(lane(3, released))
    assert released == [] and not old_first.streams.closed  # both still read: they go when they end
    reading.close()
    busy.close()
    lanes.pick(lambda: lane(4, released))
    assert sorted(released) == [1, 2] and old_first.streams.closed and extra.streams.closed
    lanes.close()
    assert sorted(released) == [1, 2, 3]
