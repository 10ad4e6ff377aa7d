"""The Worker gRPC service: a trainer's Fetch stream sends one request per
batch it wants (its credits) and receives the frames as they are ready."""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import grpc

from dpex.proto import worker_pb2 as wpb
from dpex.rpc import servicer_method
from dpex.worker.scheduler import Key, Scheduler

log = logging.getLogger("dpex.worker")

_SERVICE = "dpex.v1.Worker"


class WorkerService:
    def __init__(self, scheduler: Scheduler, inspect: Callable[[int], bytes]) -> None:
        self._scheduler = scheduler
        self._inspect = inspect

    def handler(self) -> grpc.GenericRpcHandler:
        # Responses are pre-serialized Batch frames built by the pool's
        # processes: no response_serializer, the bytes go out as they are.
        return grpc.method_handlers_generic_handler(_SERVICE, {
            "Fetch": grpc.stream_stream_rpc_method_handler(
                self.Fetch, request_deserializer=wpb.FetchRequest.FromString),
            "Inspect": grpc.unary_unary_rpc_method_handler(
                servicer_method(self.Inspect), request_deserializer=wpb.InspectRequest.FromString),
        })

    def Inspect(self, request, context):
        return self._inspect(request.job_id)  # already serialized by the pool

    def Fetch(self, request_iterator, context: grpc.ServicerContext):
        out: queue.SimpleQueue = queue.SimpleQueue()
        sink = out.put
        context.add_callback(lambda: out.put(None))  # the RPC ended: stop yielding

        def read() -> None:
            try:
                for r in request_iterator:
                    self._scheduler.request(Key(r.epoch, r.seq, r.consumer_index, r.job_id), sink)
            except Exception as e:  # the client went away mid-message
                log.debug("fetch stream closed: %s", e)

        # The reader ends with the RPC (its iterator ends or raises).
        reader = threading.Thread(target=read, name="dpex-fetch-reader", daemon=True)
        reader.start()
        try:
            while True:
                frame = out.get()
                if frame is None:
                    return
                yield frame
        finally:
            self._scheduler.cancel(sink)
