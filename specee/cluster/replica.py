"""One replica: an engine with continuous batching behind the whole single-process app, which
runs each forwarded request in process and reports its metrics and slots to the ingress."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import AsyncIterator

from ray import serve

from .asgi import Forwarded, Start, call

REPORT_S = 1.0  # how often a replica tells the ingress its metrics and slots

log = logging.getLogger("ray.serve")


class Replica:
    async def __init__(self, spec, ingress: str) -> None:
        from concurrent.futures import ThreadPoolExecutor
        from dataclasses import replace

        from ..engine import load_engine
        from ..server.app import create_app, model_id_of

        # Loaded on a thread that then ends: no OpenMP pool left on the event loop's thread
        # (a second pool slows the scheduler's passes; see specee.cli.loading.load_off_main_thread).
        with ThreadPoolExecutor(max_workers=1) as pool:
            engine = pool.submit(lambda: load_engine(**spec.load.keywords())).result()
        config = replace(spec.server, model_id=model_id_of(engine))
        self.app = create_app(engine, config)
        self.scheduler = self.app.state.scheduler
        self.scheduler.start()  # the app's lifespan would; nothing runs it here
        self.max_batch = config.max_batch
        context = serve.get_replica_context()
        self.id = context.replica_id.unique_id
        self.ingress = serve.get_deployment_handle(ingress, app_name=context.app_name)
        self.reporter = asyncio.get_running_loop().create_task(self._report())

    async def forward(self, request: Forwarded) -> AsyncIterator[Start | bytes]:
        async for part in call(self.app, request):
            yield part

    def snapshot(self) -> dict:
        return {"replica": self.id, "pid": os.getpid(), "max_batch": self.max_batch,
                "queued": self.scheduler.queued, "running": self.scheduler.running,
                "slots": [dict(slot, replica=self.id) for slot in self.scheduler.slots()],
                "metrics": self.app.state.metrics.exposition().decode()}

    async def _report(self) -> None:
        while True:
            try:
                await self.ingress.report.remote(self.snapshot())
            except Exception as e:  # the ingress restarting: the next report reaches the new one
                log.warning("specee replica %s could not report to the ingress: %s", self.id, e)
            await asyncio.sleep(REPORT_S)

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose scheduler thread has died."""
        if not self.scheduler.alive:
            raise RuntimeError("the scheduler thread has stopped")

    def __del__(self) -> None:
        """Ray Serve calls this after the replica's ongoing requests have finished (or its graceful
        shutdown timeout passed): end what still runs with an error event, then stop. Also after a
        constructor that failed part way."""
        if hasattr(self, "reporter"):
            self.reporter.cancel()
        if hasattr(self, "scheduler"):
            self.scheduler.drain(time.monotonic() + 1.0)
            self.scheduler.stop()
