"""A loader's state dict: where its epochs stand, in a few numbers.

``RemoteDataLoader.state_dict()`` returns plain Python values, bytes as
base64 text (torch.save them with the model, or json.dumps them): the number of ``iter()`` calls so far, the epoch in
progress as it was sent to the dispatcher (its base seed and sampler
description, its index batches for a sampler Dpex cannot describe, or its
number of streams for an IterableDataset), the batches of it the training
loop was given (seq ranges), and the state of the loader's own generator and
of a sampler that has a ``state_dict``. A new loader given it by
``load_state_dict`` submits that epoch again with those batches marked done,
so it yields the rest, then plans the next epochs as the interrupted loader
would have.

Elastic resume (:func:`reshard`): the states of all N ranks of a run, given
to each of M ranks, make the rest of the interrupted epoch M shares by
DistributedSampler's rule; the epoch state then keeps the N states it came
from (small), not the shares it computed.
"""
from __future__ import annotations

import base64
import math
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any

from dpex.errors import DpexConfigError
from dpex.plan.seq import Watermark, stream_of, stream_seq
from dpex.proto import dispatcher_pb2 as dpb

FORMAT = "dpex.RemoteDataLoader"
VERSION = 2


class Progress:
    """The batches (seqs) of an epoch handed to the training loop, as a
    watermark (dpex.plan.seq.Watermark). With ``num_streams`` (an
    IterableDataset), batch j of stream k is seq j*N+k, and a stream's seqs
    past its end (``ends``) count as passed."""

    def __init__(self, done: list[tuple[int, int]] = (), num_streams: int = 0,
                 ends: dict[int, int] | None = None,
                 stream_states: dict[int, tuple[int, bytes]] | None = None,
                 starts: dict[int, bytes] | None = None) -> None:
        self.ended = False  # the loop saw the epoch's end (StopIteration)
        self.repeats = 0    # batches given again (even_batches="longest": seq -1), past this consumer's own
        self.num_streams = num_streams
        self.ends: dict[int, int] = dict(ends or {})  # stream -> its number of batches, once known
        # A dataset with its own state_dict: stream -> (j, its state after batch j-1), j the
        # stream's first batch not given; states of batches given past a gap wait in _states.
        self.stream_states: dict[int, tuple[int, bytes]] = dict(stream_states or {})
        # A job that keeps its dataset (persistent_workers, num_workers=0): stream -> its dataset, pickled on a
        # worker (never unpickled here), as the epoch's stream started with it and as it ended it.
        self.starts: dict[int, bytes] = dict(starts or {})
        self.carried: dict[int, bytes] = {}
        self._offered: dict[int, bytes] = {}  # seq -> state, received, not given to the loop yet
        self._states: dict[int, bytes] = {}   # seq -> state, given, past a gap in its stream
        self._given = Watermark(num_streams, self.ends, done=done)
        self._lock = threading.Lock()  # the fetcher learns ends in its thread; the loop adds seqs

    def exists(self, seq: int) -> bool:
        return self._given.exists(seq)

    def add(self, seq: int) -> None:
        with self._lock:
            if seq < 0:  # a repeat (dpex.client.gate)
                self.repeats += 1
                return
            self._given.mark(seq)
            state = self._offered.pop(seq, None)
            if state is not None:
                self._states[seq] = state
                self._advance_stream(stream_of(seq, self.num_streams)[0])

    def was_given(self, seq: int) -> bool:
        """Batch ``seq`` went to the loop (or was given before the checkpoint, or skipped)."""
        with self._lock:
            return self._given.passed(seq)

    def carry(self, stream: int, replica: bytes) -> None:
        """Stream ``stream``'s dataset as it ended the epoch: the next epoch's stream iterates it."""
        with self._lock:
            self.carried[stream] = replica

    def next_starts(self) -> dict[int, bytes]:
        """The datasets the next epoch's streams start from: as this one ended them (or began them)."""
        with self._lock:
            return {**self.starts, **self.carried}

    def offer(self, seq: int, state: bytes) -> None:
        """The dataset's state after batch ``seq``, kept once the loop is given the batch."""
        with self._lock:
            self._offered[seq] = state

    def _advance_stream(self, k: int) -> None:
        j, state = self.stream_states.get(k, (0, b""))
        while self._given.passed(stream_seq(k, j, self.num_streams)) and stream_seq(k, j, self.num_streams) in self._states:
            state = self._states.pop(stream_seq(k, j, self.num_streams))
            j += 1
        if state:
            self.stream_states[k] = (j, state)

    def end_stream(self, stream: int, end: int) -> None:
        """Stream ``stream`` has ``end`` batches: its later seqs never come."""
        with self._lock:
            self.ends[stream] = min(self.ends.get(stream, end), end)
            self._given.settle()

    @property
    def count(self) -> int:
        return len(self.seqs())

    def seqs(self) -> set[int]:
        with self._lock:
            return self._given.seqs()

    def ranges(self) -> list[tuple[int, int]]:
        with self._lock:
            return self._given.ranges()


@dataclass
class EpochState:
    """One epoch as the dispatcher was sent it, and how far the loop got."""
    epoch: int
    base_seed: int
    num_batches: int
    sampler: dpb.SamplerSpec | None = None
    batches: list[dpb.IndexBatch] | None = None  # a sampler Dpex cannot describe, or a share (reshard)
    progress: Progress = field(default_factory=Progress)
    num_streams: int = 0  # an IterableDataset's epoch
    reshard: dict[str, Any] | None = None  # elastic: what ``batches`` were computed from (see reshard)
    drawn: int = 0  # draws the sampler made from the user's generator (see dpex.client.paced)
    end: Any = None  # an explicit plan's: the loader's generator's state once its sampler ran out
    draw: Any = None  # the epoch's live draws (dpex.client.sampling.EpochDraw), whose count a state keeps

    @property
    def draws(self) -> int:
        return self.draw.drawn if self.draw is not None else self.drawn

    @property
    def end_state(self) -> Any:
        return self.draw.end if self.draw is not None else self.end

    def to_dict(self) -> dict[str, Any]:
        explicit = self.batches is not None and self.reshard is None
        return {"epoch": self.epoch, "base_seed": self.base_seed, "num_batches": self.num_batches,
                "sampler": blob(self.sampler.SerializeToString()) if self.sampler is not None else None,
                "batches": [list(b.indices) for b in self.batches] if explicit else None,
                "whole": [i for i, b in enumerate(self.batches) if b.whole] if explicit else [],
                "places": self.place_batches() if explicit else None,
                "reshard": self.reshard, "num_streams": self.num_streams, "drawn": self.draws,
                "generator_end": pack_state(self.end_state) if self.end_state is not None else None,
                # Pairs, not dicts with int keys: a state survives a JSON round trip (keys become strings).
                "ends": sorted([k, n] for k, n in self.progress.ends.items()),
                "done": [list(r) for r in self.progress.ranges()],
                "stream_states": [[k, j, blob(state)] for k, (j, state) in sorted(self.progress.stream_states.items())],
                "starts": [[k, blob(r)] for k, r in sorted(self.progress.starts.items())],
                "repeats": self.progress.repeats}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EpochState":
        state = cls._from_dict(d)
        state.progress.repeats = d.get("repeats", 0)
        return state

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> "EpochState":
        batches = [dpb.IndexBatch(indices=b) for b in d["batches"]] if d["batches"] is not None else None
        for i in d.get("whole", []):  # an unbatched job's list elements
            batches[i].whole = True
        for batch, places in zip(batches or [], d.get("places") or []):
            batch.places[:] = places
        if d["reshard"] is not None:
            batches = reshard(**d["reshard"])
        return cls(d["epoch"], d["base_seed"], d["num_batches"] if batches is None else len(batches),
                   sampler=dpb.SamplerSpec.FromString(unblob(d["sampler"])) if d["sampler"] is not None else None,
                   batches=batches, num_streams=d["num_streams"], reshard=d["reshard"], drawn=d.get("drawn", 0),
                   end=unpack_state(d["generator_end"]) if d.get("generator_end") else None,
                   progress=Progress([tuple(r) for r in d["done"]], d["num_streams"],
                                     {k: n for k, n in pairs(d["ends"])},
                                     {k: (j, unblob(state)) for k, (j, state) in pairs(d["stream_states"])},
                                     {k: unblob(r) for k, r in pairs(d.get("starts", []))}))

    def index_batches(self) -> list[list[int]]:
        """Every index batch of the epoch, in seq order."""
        if self.batches is not None:
            return [list(b.indices) for b in self.batches]
        from dpex.plan import samplers
        return samplers.batches(self.sampler, 0, self.num_batches)

    def place_batches(self) -> list[list[int]] | None:
        """The places of every batch's samples (dpex.seeding); None: an explicit plan sent without them."""
        if self.batches is not None:
            return [list(b.places) for b in self.batches] if self.batches and self.batches[0].places else None
        from dpex.plan import samplers
        return samplers.places(self.sampler, 0, self.num_batches)


def reshard(sources: list[dict[str, Any] | None], world: int, rank: int, batch_size: int,
            drop_last: bool, sampler_drop_last: bool) -> list[dpb.IndexBatch]:
    """Rank ``rank`` of ``world``'s share of what the loop of no rank of
    ``sources`` (each old rank's epoch dict; None: its loop had the whole
    epoch) had been given: the samples left, in the order of the old ranks'
    interleaved sample lists (DistributedSampler's global order), each once,
    padded (or cut, ``sampler_drop_last``) to a multiple of ``world`` as
    DistributedSampler does, every ``world``-th from ``rank``, in batches.
    Each sample keeps its place in the old epoch (its draws, dpex.seeding);
    a padding copy, the place of the sample it copies."""
    seen: set[int] = set()
    left: list[tuple[int, int, int, int | None]] = []  # (position in its rank's samples, old rank, index, place)
    for old_rank, d in enumerate(sources):
        if d is None:
            continue
        state = EpochState.from_dict(d)
        given = state.progress.seqs()
        position = 0
        places = state.place_batches()
        for seq, batch in enumerate(state.index_batches()):
            if seq in given:
                seen.update(batch)
            else:
                where = places[seq] if places is not None else [None] * len(batch)
                left.extend((position + i, old_rank, index, place)
                            for i, (index, place) in enumerate(zip(batch, where)))
            position += len(batch)
    rest: list[tuple[int, int | None]] = []
    for _, _, index, place in sorted(left, key=lambda entry: entry[:2]):
        if index not in seen:
            seen.add(index)
            rest.append((index, place))
    if sampler_drop_last and len(rest) % world:
        rest = rest[:len(rest) - len(rest) % world]
    elif rest:
        pad = -len(rest) % world
        rest += (rest * math.ceil(pad / len(rest)))[:pad]
    mine = rest[rank::world]
    out = [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]
    if drop_last and out and len(out[-1]) < batch_size:
        out = out[:-1]
    return [dpb.IndexBatch(indices=[index for index, _ in batch],
                           places=[place for _, place in batch] if all(p is not None for _, p in batch) else [])
            for batch in out]


def elastic(states: list[dict[str, Any]], world: int, rank: int, batch_size: int,
            drop_last: bool) -> EpochState | None:
    """The interrupted epoch of the N ranks' ``states`` as rank ``rank`` of
    ``world`` resumes it; None when it was between epochs."""
    sources = [sd["epoch"] for sd in states]
    planned = [d for d in sources if d is not None]
    if not planned:
        return None
    if any(d["num_streams"] for d in planned):
        raise DpexConfigError("load_state_dict: an IterableDataset epoch cannot be resumed with another "
                              "number of consumers; take the checkpoint between epochs")
    spec = dpb.SamplerSpec.FromString(unblob(planned[0]["sampler"])) if planned[0]["sampler"] is not None else None
    args = dict(sources=sources, world=world, rank=rank, batch_size=batch_size, drop_last=drop_last,
                sampler_drop_last=bool(spec is not None and spec.kind in (spec.DISTRIBUTED, spec.SHUFFLE)
                                       and spec.sampler_drop_last))
    base = sources[rank % len(sources)] or planned[0]
    batches = reshard(**args)
    return EpochState(base["epoch"], base["base_seed"], len(batches), batches=batches, reshard=args)


def pairs(value: Any) -> list[tuple[int, Any]]:
    """(stream, value) from a state's list of ``[stream, *value]`` or from a
    dict (older states; after a JSON round trip its keys are strings)."""
    if isinstance(value, dict):
        return [(int(k), tuple(v) if isinstance(v, list) else v) for k, v in value.items()]
    return [(int(k), rest[0] if len(rest) == 1 else tuple(rest)) for k, *rest in value]


def blob(data: bytes) -> str:
    """Bytes as base64 text: a state dict is plain JSON-safe values, for
    ``torch.save`` and ``json.dumps`` alike (torchdata's states round-trip
    through JSON)."""
    return base64.b64encode(data).decode("ascii")


def unblob(value: Any) -> bytes:
    """The bytes of :func:`blob`'s text (or of an older state's byte tensor)."""
    if isinstance(value, str):
        return base64.b64decode(value.encode("ascii"), validate=True)
    return value if isinstance(value, bytes) else value.numpy().tobytes()


def pack_generator(generator: Any) -> Any:
    """A torch.Generator's state, zlib'd (its 32-bit words sit in 64-bit slots)."""
    return pack_state(generator.get_state())


def pack_state(state: Any) -> Any:
    """A generator's state tensor as :func:`pack_generator` keeps it."""
    return blob(zlib.compress(state.numpy().tobytes()))


def unpack_state(packed: Any) -> Any:
    import torch
    return torch.frombuffer(bytearray(zlib.decompress(unblob(packed))), dtype=torch.uint8)


def restore_generator(generator: Any, packed: Any) -> None:
    generator.set_state(unpack_state(packed))


def check(sd: Any, length: int, batch_size: int | None) -> None:
    """Refuses a state dict this loader cannot continue, saying why."""
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        raise DpexConfigError("load_state_dict: not a RemoteDataLoader state dict "
                              f"(expected a dict with format={FORMAT!r}, or a list of them, one per rank)")
    if sd.get("version") != VERSION:
        raise DpexConfigError(f"load_state_dict: state dict version {sd.get('version')!r}; this Dpex "
                              f"reads version {VERSION}")
    for what, saved, mine in (("dataset length", sd["dataset_length"], length),
                              ("batch size", sd["batch_size"], batch_size)):
        if saved != mine:
            raise DpexConfigError(f"load_state_dict: the state was saved by a loader with {what} {saved}, "
                                  f"this loader has {what} {mine}; build it with the same dataset and arguments")


def select(state: Any, num_consumers: int, consumer_index: int,
           job_name: str | None) -> tuple[dict[str, Any], EpochState | None]:
    """The state dict this consumer goes on from, and its epoch: its own, or
    (given every rank's, saved by another number of ranks) the rest of the
    epoch resharded. ``state`` is one state dict or a list of all ranks';
    ``job_name``: the name the user gave this loader's job, if any (a job of
    another name is refused, but for an elastic resume, whose job is new)."""
    if isinstance(state, dict):
        if (state["num_consumers"], state["consumer_index"]) != (num_consumers, consumer_index):
            raise DpexConfigError(
                f"load_state_dict: the state was saved by consumer {state['consumer_index']} of "
                f"{state['num_consumers']}, this loader is consumer {consumer_index} of {num_consumers}; "
                "to resume with another number of consumers, give every rank the list of all "
                f"{state['num_consumers']} ranks' state dicts")
        if job_name and state["named_job"] and state["job_name"] != job_name:
            raise DpexConfigError(f"load_state_dict: the state was saved by job {state['job_name']!r}, "
                                  f"this loader's job is {job_name!r}")
        return state, EpochState.from_dict(state["epoch"]) if state["epoch"] is not None else None
    states = sorted(state, key=lambda sd: sd["consumer_index"])
    n = len(states)
    if [(sd["num_consumers"], sd["consumer_index"]) for sd in states] != [(n, i) for i in range(n)]:
        raise DpexConfigError(
            "load_state_dict: a list of state dicts must hold one of every rank of the run that saved them "
            f"(got consumers {[sd['consumer_index'] for sd in states]} of "
            f"{sorted({sd['num_consumers'] for sd in states})})")
    if len({sd["epochs_started"] for sd in states}) > 1:
        raise DpexConfigError("load_state_dict: the ranks' state dicts were taken at different epochs "
                              f"({sorted({sd['epochs_started'] for sd in states})} iter() calls)")
    if n == num_consumers:
        return select(states[consumer_index], num_consumers, consumer_index, job_name)
    base = states[consumer_index % n]
    return base, elastic(states, num_consumers, consumer_index, base["batch_size"], base["drop_last"])
