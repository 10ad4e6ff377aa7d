"""dpex.plan.seq: every seq arithmetic of an epoch, and dpex.plan.spec: what
identifies a plan and how an explicit one is cut into chunks."""
from hypothesis import given, strategies as st

from dpex.plan import seq
from dpex.plan.spec import PlanHash, chunks, resumed
from dpex.proto import dispatcher_pb2 as dpb


@given(st.integers(1, 50), st.integers(1, 9), st.integers(0, 500))
def test_a_map_style_seq_lies_in_the_split_its_index_names(num_batches, split_size, s):
    s %= num_batches
    index = seq.split_index(s, split_size)
    first = seq.first_seq(index, split_size)
    assert s in seq.split_seqs(first, min(split_size, num_batches - first))


@given(st.integers(1, 8), st.integers(0, 100), st.integers(0, 100))
def test_a_streams_seq_and_back(num_streams, stream, j):
    stream %= num_streams
    s = seq.stream_seq(stream, j, num_streams)
    assert seq.stream_of(s, num_streams) == (stream, j)
    assert seq.split_index(s, 4, num_streams) == stream == seq.first_seq(stream, 4, num_streams)


def test_seqs_past_a_streams_end_do_not_exist_and_the_limit_follows_the_last_stream():
    ends = {0: 2, 1: 3}
    assert [s for s in range(10) if seq.stream_seq_exists(s, 3, ends)] == [0, 1, 2, 3, 4, 5, 7, 8]
    assert seq.streams_limit(3, ends) is None  # stream 2 may go on
    assert seq.streams_limit(3, {**ends, 2: 1}) == 8  # stream 1's third batch, seq 7, is the last
    assert seq.streams_limit(2, {0: 0, 1: 0}) == 0



def test_a_watermark_passes_seqs_in_any_order_and_those_that_cannot_come():
    w = seq.Watermark(num_batches=6)
    for s in (2, 0, 4):
        w.mark(s)
    assert (w.low, w.ahead, w.ranges()) == (1, {2, 4}, [(0, 1), (2, 3), (4, 5)])
    w.mark(1)
    assert (w.low, w.ahead) == (3, {4}) and [s for s in range(8) if w.passed(s)] == [0, 1, 2, 4]
    w.mark(3)
    w.mark(5)
    assert w.low == 6 == w.limit() and w.seqs() == set(range(6))
    # Streams: seqs past a stream's end cannot come; the caller's ends dict is shared.
    ends: dict[int, int] = {}
    s = seq.Watermark(num_streams=2, ends=ends, done=[(0, 2), (3, 4)])
    assert (s.low, s.seqs()) == (2, {0, 1, 3})
    ends[0] = 1  # stream 0 had one batch: seqs 2 and 4 never come
    s.settle()
    assert (s.low, s.limit()) == (5, None) and not s.exists(4) and not s.passed(2)
    ends[1] = 2  # nor seq 5: the last seq is 3
    s.settle()
    assert s.limit() == 4 and s.seqs() == {0, 1, 3} and s.ranges() == [(0, 5)]

def test_a_plan_hashes_alike_when_sent_again_and_a_resumed_one_as_a_plan_of_its_own():
    batches = [dpb.IndexBatch(indices=[1, 2]), dpb.IndexBatch(indices=[3], places=[5])]

    def digest(base_seed=7, streams=0, parts=((0, 2),)):
        h = PlanHash(base_seed, streams)
        for a, b in parts:
            h.update(batches[a:b])
        return h.digest()
    assert digest() == digest(parts=((0, 1), (1, 2)))  # however it was chunked
    assert len({digest(), digest(base_seed=8), digest(streams=2)}) == 3
    assert resumed(digest(), [], 0) == digest()
    assert resumed(digest(), [dpb.SeqRange(start=0, end=1)], 9) != resumed(digest(), [], 9) != digest()


def test_an_explicit_plan_is_cut_into_whole_batches_of_bounded_indices():
    batches = [dpb.IndexBatch(indices=list(range(n))) for n in (3, 3, 5, 1, 2)]
    parts = list(chunks(batches, max_indices=6))
    assert [[len(b.indices) for b in part] for part in parts] == [[3, 3], [5, 1], [2]]
    assert [len(b.indices) for b in list(chunks([dpb.IndexBatch(indices=list(range(9)))], 4))[0]] == [9]
    assert list(chunks([])) == [[]]
