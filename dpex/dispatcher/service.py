"""The Dispatcher gRPC service: a table that forwards each call, with the
caller's address, to dpex.dispatcher.core, maps its DpexErrors to status
codes (dpex.rpc.servicer_method) and answers once what the call changed is
durable. Nothing else: the dispatcher's logic is the core's."""
from __future__ import annotations

import functools
import inspect

from dpex.dispatcher.core import DispatcherCore
from dpex.proto import dispatcher_pb2_grpc as dgrpc
from dpex.rpc import servicer_method


def answered_durably(method):
    """Answers (or fails) only once every update applied before is durable:
    the group commit of dpex.dispatcher.store. No answer reveals a state that
    a crash could take back."""
    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def coroutine(self, request, context):
            try:
                return await method(self, request, context)
            finally:
                store = self.core.store
                if store is not None:
                    await store.settled(store.appended)
        return coroutine

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        finally:
            store = self.core.store
            if store is not None:
                store.settle(store.appended)
    return wrapper


class DispatcherService(dgrpc.DispatcherServicer):
    def __init__(self, core: DispatcherCore) -> None:
        self.core = core

    @servicer_method
    @answered_durably
    def RegisterWorker(self, request, context):
        return self.core.register_worker(request, context.peer())

    @servicer_method
    @answered_durably
    async def WorkerHeartbeat(self, request, context):
        # A coroutine on the server's loop: a fleet's long polls hold no thread.
        return await self.core.worker_heartbeat(request, context.peer())

    @servicer_method
    @answered_durably
    def DeregisterWorker(self, request, context):
        return self.core.deregister_worker(request, context.peer())

    @servicer_method
    @answered_durably
    def ReportWorker(self, request, context):
        return self.core.report_worker(request, context.peer())

    @servicer_method
    @answered_durably
    def GetOrCreateJob(self, request, context):
        return self.core.get_or_create_job(request, context.peer())

    @servicer_method
    @answered_durably
    def GetJob(self, request, context):
        return self.core.get_job(request, context.peer())

    @servicer_method
    @answered_durably
    def SubmitPlan(self, request, context):
        return self.core.submit_plan(request, context.peer())

    @servicer_method
    @answered_durably
    async def SyncConsumer(self, request, context):
        return await self.core.sync_consumer(request, context.peer())

    @servicer_method
    @answered_durably
    def ReleaseConsumer(self, request, context):
        return self.core.release_consumer(request, context.peer())

    @servicer_method
    @answered_durably
    def GetStatus(self, request, context):
        return self.core.get_status(request, context.peer())
