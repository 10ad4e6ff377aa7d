"""A fuzzer on every port of a cluster: the dispatcher's and the worker's gRPC
methods (random bytes, random valid messages, and valid messages mutated), the
worker's data port (random bytes, keys of every length, silence), the metrics
port's HTTP (random requests and garbage), and the trainer's frame decoder
(valid batch frames mutated and truncated, as a bad link or a bad peer would
hand them over).

An input passes when the daemon answers it with a status of the protocol (or
closes the connection) and keeps serving; the decoder must return or raise a
``DpexWireError``. Counted against that: ``unhandled`` (gRPC's UNKNOWN — an
exception escaped a servicer —, an HTTP 5xx, an error of another type from the
decoder), ``hangs`` (no answer within its deadline where one is due),
``crashes`` (a daemon that stopped), and, after each port's run, whether a
real job still gets every batch of an epoch.
"""
from __future__ import annotations

import random
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

PORTS = ("dispatcher", "worker", "data", "http", "frames")
UNARY_DEADLINE_S = 5.0   # an answer is due within this
FETCH_DEADLINE_S = 0.3   # a Fetch stream that parsed is held open (as a trainer's), until this
FETCH_MESSAGES = 20      # fuzzed requests sent on one Fetch stream
THREADS = 8
_tally = threading.Lock()


@dataclass
class FuzzReport:
    """One port's tally."""
    port: str
    inputs: int = 0
    outcomes: Counter = field(default_factory=Counter)  # status code (or "answered", "closed"), by count
    unhandled: list[str] = field(default_factory=list)  # a few examples
    unhandled_count: int = 0
    hangs: int = 0
    crashes: int = 0
    job_after: bool | None = None  # a real job got every batch after the run
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.unhandled_count or self.hangs or self.crashes) and self.job_after is not False

    def record(self, outcome: str, inputs: int = 1, bad: str | None = None) -> None:
        """``inputs`` inputs met ``outcome`` ("hang": no answer in time); ``bad``:
        what was wrong with it, if anything (threads call this at once)."""
        with _tally:
            self.inputs += inputs
            self.outcomes[outcome] += 1
            self.hangs += outcome == "hang"
            if bad is not None:
                self.unhandled_count += 1
                if len(self.unhandled) < 5:
                    self.unhandled.append(bad[:500])

    def __str__(self) -> str:
        top = ", ".join(f"{k} {v}" for k, v in self.outcomes.most_common(6))
        return (f"{self.port}: {self.inputs} inputs in {self.seconds:.0f}s, unhandled {self.unhandled_count}, "
                f"hangs {self.hangs}, crashes {self.crashes}, a real job after: {self.job_after}; {top}")


# ---- inputs -------------------------------------------------------------------------------

_EDGE_INTS = (0, 1, 2, 7, 127, 128, 255, 2 ** 31 - 1, 2 ** 32 - 1, 2 ** 63 - 1, 2 ** 64 - 1)


def random_message(cls: type, rng: random.Random, depth: int = 0) -> Any:
    """A valid message of ``cls`` with random field values (edge values often)."""
    from google.protobuf.descriptor import FieldDescriptor as F
    msg = cls()
    for f in cls.DESCRIPTOR.fields:
        if rng.random() < 0.4:
            continue
        count = rng.randint(0, 3) if f.is_repeated else 1
        for _ in range(count):
            if f.type == F.TYPE_MESSAGE:
                if depth >= 3 or f.message_type.GetOptions().map_entry:
                    continue
                value = random_message(getattr(msg, f.name).__class__ if not f.is_repeated
                                       else _message_class(f.message_type), rng, depth + 1)
                if f.is_repeated:
                    getattr(msg, f.name).append(value)
                else:
                    getattr(msg, f.name).CopyFrom(value)
                continue
            value = _scalar(f, rng)
            if f.is_repeated:
                getattr(msg, f.name).append(value)
            else:
                setattr(msg, f.name, value)
    return msg


def _message_class(descriptor: Any) -> type:
    from google.protobuf import message_factory
    return message_factory.GetMessageClass(descriptor)


def _scalar(f: Any, rng: random.Random) -> Any:
    from google.protobuf.descriptor import FieldDescriptor as F
    t = f.type
    if t in (F.TYPE_STRING,):
        return "".join(rng.choice("ab/:.-_0é\x00 ") for _ in range(rng.randint(0, 20)))
    if t == F.TYPE_BYTES:
        return rng.randbytes(rng.choice((0, 1, 16, 32, rng.randint(0, 300))))
    if t == F.TYPE_BOOL:
        return rng.random() < 0.5
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return rng.choice((0.0, -1.0, 1e-9, 1e30, float("inf"), float("nan"), rng.uniform(-1e3, 1e3)))
    if t == F.TYPE_ENUM:
        return rng.choice([v.number for v in f.enum_type.values] + [99])
    bits = 32 if t in (F.TYPE_INT32, F.TYPE_UINT32, F.TYPE_SINT32, F.TYPE_FIXED32, F.TYPE_SFIXED32) else 64
    signed = t in (F.TYPE_INT32, F.TYPE_INT64, F.TYPE_SINT32, F.TYPE_SINT64, F.TYPE_SFIXED32, F.TYPE_SFIXED64)
    n = rng.choice(_EDGE_INTS) if rng.random() < 0.5 else rng.getrandbits(rng.choice((4, 16, bits)))
    n &= (1 << (bits - 1 if signed else bits)) - 1
    return -n if signed and rng.random() < 0.3 else n


def mutate(data: bytes, rng: random.Random) -> bytes:
    """``data`` with a few random edits: bits flipped, bytes set, a cut, an
    insertion, a piece repeated."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(5)
        if kind == 0 and b:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif kind == 1 and b:
            b[rng.randrange(len(b))] = rng.choice((0, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        elif kind == 2 and b:
            del b[rng.randrange(len(b)):]
        elif kind == 3:
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randint(1, 16))
        elif b:
            i = rng.randrange(len(b))
            j = rng.randrange(i, min(len(b), i + 32) + 1)
            b[i:i] = b[i:j] * rng.randint(1, 8)
    return bytes(b)


def _body(cls: type, rng: random.Random) -> bytes:
    """Random bytes, a valid message, or a valid message mutated."""
    r = rng.random()
    if r < 0.2:
        return rng.randbytes(rng.randint(0, 512))
    data = random_message(cls, rng).SerializeToString()
    return data if r < 0.5 else mutate(data, rng)


# ---- ports -----------------------------------------------------------------------------

def _methods(service: str) -> list[tuple[str, type, bool]]:
    """(name, request class, client-streaming) of each method of ``service``."""
    from dpex.proto import dispatcher_pb2, worker_pb2
    module = dispatcher_pb2 if service == "Dispatcher" else worker_pb2
    desc = module.DESCRIPTOR.services_by_name[service]
    return [(m.name, _message_class(m.input_type), m.client_streaming) for m in desc.methods]


def fuzz_grpc(address: str, service: str, inputs: int, rng: random.Random, report: FuzzReport,
              alive: Callable[[], bool]) -> None:
    """``inputs`` fuzzed requests to ``service``'s methods at ``address``."""
    import grpc

    from dpex.rpc import CHANNEL_OPTIONS
    methods = _methods(service)

    def one(seed: int) -> None:
        r = random.Random(seed)
        name, cls, streaming = r.choice(methods)
        path = f"/dpex.v1.{service}/{name}"
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
            total = 0
            for _ in range(50):  # 50 inputs; a stream ended early (refused) carried fewer of its messages
                if total >= 50:
                    break
                sent, outcome = _call(ch, path, cls, streaming, r, grpc)
                total += sent
                report.record(outcome, sent, f"{name}: an exception escaped the servicer" if outcome == "UNKNOWN"
                              else None)
    _pooled(one, max(1, inputs // 50), rng, report, alive, check_every=1)  # 50 inputs a task


def _call(ch: Any, path: str, cls: type, streaming: bool, r: random.Random, grpc: Any) -> tuple[int, str]:
    if not streaming:
        call = ch.unary_unary(path, request_serializer=None, response_deserializer=None)
        start = time.monotonic()
        try:
            call(_body(cls, r), timeout=UNARY_DEADLINE_S)
            return 1, "answered"
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - start >= UNARY_DEADLINE_S * 0.9:
                return 1, "hang"
            return 1, code.name
    call = ch.stream_stream(path, request_serializer=None, response_deserializer=None)
    bodies = [_body(cls, r) for _ in range(FETCH_MESSAGES)]
    sent = [0]

    def requests():
        for b in bodies:
            sent[0] += 1
            yield b
    try:
        for _ in call(requests(), timeout=FETCH_DEADLINE_S):
            pass
        return sent[0], "answered"
    except grpc.RpcError as e:
        return sent[0], e.code().name  # DEADLINE_EXCEEDED: a stream that parsed, held open as a trainer's


def _pooled(one: Callable[[int], None], tasks: int, rng: random.Random, report: FuzzReport,
            alive: Callable[[], bool], check_every: int = 1000) -> None:
    """``one(seed)`` for ``tasks`` seeds on THREADS threads, the daemons checked every ``check_every``."""
    seeds = [rng.getrandbits(64) for _ in range(tasks)]
    with ThreadPoolExecutor(THREADS) as pool:
        for i, f in enumerate([pool.submit(one, s) for s in seeds]):
            f.result()
            if i % check_every == 0 and not alive():
                report.crashes += 1
                return


def fuzz_data_port(host: str, port: int, inputs: int, rng: random.Random, report: FuzzReport,
                   alive: Callable[[], bool]) -> None:
    """Connections to a worker's data port sending random bytes, keys of every
    length (a key is 16 bytes), or nothing: each is closed by the port."""
    def one(seed: int) -> None:
        r = random.Random(seed)
        kind = r.randrange(4)
        payload = {0: r.randbytes(r.randint(1, 4096)), 1: r.randbytes(16), 2: r.randbytes(r.randint(1, 15)),
                   3: b""}[kind]
        try:
            with socket.create_connection((host, port), timeout=UNARY_DEADLINE_S) as s:
                if payload:
                    s.sendall(payload)
                if kind in (2, 3):  # a short key or silence: the port waits its handshake time, then closes
                    s.shutdown(socket.SHUT_WR)
                s.settimeout(UNARY_DEADLINE_S + 6)
                got = s.recv(1)
                outcome = "closed" if not got else "answered"
        except (ConnectionResetError, BrokenPipeError, ConnectionRefusedError):
            outcome = "closed"
        except socket.timeout:
            outcome = "hang"
        report.record(outcome, bad="the data port sent bytes to a socket that sent no key it handed out"
                      if outcome == "answered" else None)
    _pooled(one, inputs, rng, report, alive)


_HTTP_PATHS = ("/", "/metrics", "/status.json", "/api", "/../../etc/passwd", "/%00", "/" + "a" * 5000, "/?x=1")


def fuzz_http(host: str, port: int, inputs: int, rng: random.Random, report: FuzzReport,
              alive: Callable[[], bool]) -> None:
    """Requests to the metrics port: valid ones on random paths and methods,
    mutated ones, and garbage; a 5xx or no answer counts against it."""
    def one(seed: int) -> None:
        r = random.Random(seed)
        path = r.choice(_HTTP_PATHS) if r.random() < 0.7 else "/" + r.randbytes(r.randint(0, 40)).hex()
        method = r.choice(("GET", "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "BREW"))
        request = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
        kind = r.random()
        if kind < 0.2:
            request = r.randbytes(r.randint(1, 2048))
        elif kind < 0.5:
            request = mutate(request, r)
        try:
            with socket.create_connection((host, port), timeout=UNARY_DEADLINE_S) as s:
                s.sendall(request)
                s.shutdown(socket.SHUT_WR)
                s.settimeout(UNARY_DEADLINE_S)
                head = b""
                while len(head) < 16:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    head += chunk
            status = head.split(b" ", 2)[1][:3].decode(errors="replace") if head.startswith(b"HTTP/") else ""
            # a request line that is not HTTP/1.x gets the standard library's HTTP/0.9 error page (no status line)
            outcome = f"HTTP {status}" if status else ("closed" if not head else "error page (HTTP/0.9)")
        except (ConnectionResetError, BrokenPipeError):
            outcome = "closed"
        except socket.timeout:
            outcome = "hang"
        report.record(outcome, bad=f"{request[:80]!r}: {outcome}" if outcome.startswith("HTTP 5") else None)
    _pooled(one, inputs, rng, report, alive)


def fuzz_frames(inputs: int, rng: random.Random, report: FuzzReport) -> None:
    """Valid batch frames (a dict of tensors, a list, a string, numpy) mutated
    or cut, through the trainer's parse and decode."""
    import numpy as np
    import torch

    from dpex.errors import DpexWireError
    from dpex.proto import worker_pb2 as wpb
    from dpex.wire.codec import decode, encode
    from dpex.wire.frame import build_frame, parse_frame
    batches = [{"x": torch.arange(12.0).reshape(3, 4), "y": torch.tensor([1, 2, 3])},
               [torch.zeros(2, 2, dtype=torch.uint8), "text", 3.5, None],
               {"a": np.arange(6, dtype=np.int16), "b": (torch.ones(1), {"c": b"raw"})}]
    frames = [build_frame(wpb.Batch(job_id=7, consumer_index=1, epoch=2, seq=s), encode(b))
              for s, b in enumerate(batches)]
    for _ in range(inputs):
        frame = mutate(rng.choice(frames), rng)
        try:
            _, payload = parse_frame(frame)
            decode(bytes(payload))
            report.record("decoded")
        except DpexWireError:
            report.record("DpexWireError")
        except Exception as e:  # noqa: BLE001 - what the fuzzer looks for
            report.record(type(e).__name__, bad=f"{type(e).__name__}: {e}")


# ---- a run ----------------------------------------------------------------------------

def real_job_gets_every_batch(address: str) -> bool:
    import dpex
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=40)
    with dpex.RemoteDataLoader(address, spec, batch_size=4, shuffle=True, seed=1, timeout=60) as dl:
        got = sorted(y for b in dl for y in b["y"].tolist())
    return got == list(range(40))


def run_fuzz(inputs: int = 1000, seed: int = 0, ports: tuple[str, ...] = PORTS) -> list[FuzzReport]:
    """Fuzzes each port of ``ports`` with ``inputs`` inputs on a fresh local
    cluster (one worker, metrics on); then checks a real job still runs."""
    from urllib.parse import urlparse

    from dpex.testing.cluster import test_cluster
    reports = []
    rng = random.Random(seed)
    with test_cluster(num_workers=1, metrics=True) as cluster:
        worker = cluster.workers[0]

        def alive() -> bool:
            return cluster.dispatcher.process.poll() is None and worker.process.poll() is None
        for port in ports:
            report = FuzzReport(port)
            start = time.monotonic()
            if port == "dispatcher":
                fuzz_grpc(cluster.address, "Dispatcher", inputs, rng, report, alive)
            elif port == "worker":
                fuzz_grpc(worker.address, "Worker", inputs, rng, report, alive)
            elif port == "data":
                fuzz_data_port(*_data_port(worker.address), inputs, rng, report, alive)
            elif port == "http":
                url = urlparse(cluster.dispatcher.metrics_url)
                fuzz_http(url.hostname, url.port, inputs, rng, report, alive)
            else:
                fuzz_frames(inputs, rng, report)
            report.seconds = time.monotonic() - start
            if not alive():
                report.crashes = max(report.crashes, 1)
            else:
                report.job_after = real_job_gets_every_batch(cluster.address)
            reports.append(report)
    return reports


def _data_port(worker_address: str) -> tuple[str, int]:
    """The worker's data port, as a trainer on another host is told it."""
    import grpc

    from dpex.proto import worker_pb2 as wpb
    from dpex.wire.pairing import PORT_METADATA, REQUEST_METADATA
    with grpc.insecure_channel(worker_address) as ch:
        call = ch.stream_stream("/dpex.v1.Worker/Fetch", request_serializer=wpb.FetchRequest.SerializeToString,
                                response_deserializer=wpb.Batch.FromString)
        stream = call(iter([]), metadata=((REQUEST_METADATA, "1"),), timeout=5)
        port = dict(stream.initial_metadata()).get(PORT_METADATA)
        stream.cancel()
    if not port:
        raise RuntimeError(f"worker {worker_address} offers no data port")
    return worker_address.rsplit(":", 1)[0], int(port)
