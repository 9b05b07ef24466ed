"""The request processes: a small process pool for the CPU-heavy part of requests (`api.work`).

The server process only moves bytes, reads the store and renders small JSON, so its
event loop and GIL stay free and status calls never wait behind a large body being
validated or simulated. The pool is created with the app (spawned, so no locks or
threads are inherited), warmed up before the server answers, and shut down with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import threading
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

from api import work
from api.errors import ApiError
from api.settings import Settings

log = logging.getLogger("mosos.api")
STARTUP_TIMEOUT_S = 120.0


class RequestPool:
    def __init__(self, settings: Settings):
        self.settings = settings
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        self._stopping = False

    def _new_executor(self) -> concurrent.futures.ProcessPoolExecutor:
        settings = self.settings.model_copy(update={"token": None})  # the processes need the limits, not the secret
        return concurrent.futures.ProcessPoolExecutor(
            max_workers=self.settings.request_processes,
            mp_context=self._context,
            initializer=work.init_process,
            initargs=(settings, os.getpid(), self.settings.request_nice),
        )

    def start(self) -> None:
        """Start every request process and wait until each has imported the planner and the strategies."""
        with self._lock:
            self._executor = self._new_executor()
            # One call per process: with nothing idle yet, each submit starts a process of its own.
            futures = [self._executor.submit(work.ready) for _ in range(self.settings.request_processes)]
        try:
            for future in futures:
                future.result(timeout=STARTUP_TIMEOUT_S)
        except BrokenProcessPool as error:
            raise RuntimeError(f"a request process could not start: {error}") from None
        except concurrent.futures.TimeoutError:
            raise RuntimeError("a request process did not start in time") from None

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    async def run(self, function: Callable[..., Any], *args: Any) -> Any:
        """`function(*args)` in a request process; its ApiError is raised here as if raised in the server."""
        with self._lock:
            executor = self._executor
            if executor is None or self._stopping:
                raise ApiError(503, "stopping", "the server is stopping")
        try:
            return await asyncio.wrap_future(executor.submit(function, *args))
        except BrokenProcessPool:
            self._replace(executor)
            raise ApiError(
                503, "request_process_lost", "a request process died while reading this request; retry it"
            ) from None
        except RuntimeError as error:  # submit after shutdown
            if self._stopping:
                raise ApiError(503, "stopping", "the server is stopping") from None
            raise error

    def _replace(self, broken: concurrent.futures.ProcessPoolExecutor) -> None:
        """A request process died (killed, out of memory): the pool is unusable, so start a fresh one."""
        with self._lock:
            if self._executor is not broken or self._stopping:
                return
            log.warning("a request process died; starting a fresh pool of %d", self.settings.request_processes)
            self._executor = self._new_executor()
        broken.shutdown(wait=False, cancel_futures=True)
