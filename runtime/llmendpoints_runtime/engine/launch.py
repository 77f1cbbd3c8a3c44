"""The engine of a pod with several API processes, launched as ``vllm serve --api-server-count``
launches it (``vllm.entrypoints.cli.serve.run_multi_api_server``): the engine's ZMQ listeners
are bound here, the engine core(s) start, and vLLM's ``APIServerProcessManager`` spawns the API
processes -- each running ``target`` (the runtime's whole app, pod/api_process.py) instead of
vLLM's bare server, with its own ``client_config`` to reach the engine.
"""

from __future__ import annotations

import logging
import socket
from argparse import Namespace
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

logger = logging.getLogger("llmendpoints.engine")

# target(listen_address, sock, args, client_config): one API process's body.
APIProcessTarget = Callable[[str, socket.socket, Namespace, dict[str, Any]], None]


def prometheus_multiprocess() -> None:
    """Every process of the pod writes its metrics where a render reads them all (vLLM's own
    set-up: a temporary PROMETHEUS_MULTIPROC_DIR, removed at exit). Before any API process
    starts."""
    from vllm.v1.metrics.prometheus import setup_multiprocess_prometheus

    setup_multiprocess_prometheus()


def name_api_process(index: int) -> None:
    """The process title vLLM gives its own API servers (``VLLM::APIServer_<index>``): what
    ``ps`` and dashboards show."""
    from vllm.utils.system_utils import set_process_title

    set_process_title("APIServer", str(index))


def mark_process_dead(pid: int) -> None:
    """Drop a finished API process's live gauges from the pod's metrics."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)


class PodEngine:
    """The engine core(s) of the pod and its API processes."""

    def __init__(self, args: Namespace, count: int) -> None:
        self.args = args
        self.count = count
        self.engine_manager: Any = None
        self.coordinator: Any = None
        self.api: Any = None
        self.listeners: Any = None
        self.max_num_seqs: int | None = None

    @property
    def api_processes(self) -> list[BaseProcess]:
        return list(self.api.processes) if self.api is not None else []

    def engine_processes(self) -> list[BaseProcess]:
        procs = list(getattr(self.engine_manager, "processes", None) or [])
        if self.coordinator is not None:
            procs.append(self.coordinator.proc)
        return procs

    def start(self, sock: socket.socket, listen_address: str, target: APIProcessTarget) -> None:
        """Start the engine and the API processes, which take ``sock`` over (it is closed here
        once they have it); returns once the engine is up (raises when
        it failed to start, or an API process exited meanwhile). Blocks: run it in a thread."""
        import vllm
        from vllm.entrypoints.launchers.cli_args import propagate_flash_late_interaction
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.utils import bind_engine_zmq_listeners, launch_core_engines
        from vllm.v1.executor import Executor
        from vllm.v1.utils import APIServerProcessManager

        engine_args = vllm.AsyncEngineArgs.from_cli_args(self.args)
        propagate_flash_late_interaction(self.args, engine_args)
        engine_args._api_process_count = self.count
        engine_args._api_process_rank = -1
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        # Held for the pod's life: vLLM unlinks the listeners' socket files when this object is
        # collected, and an engine that connects (or reconnects) after that finds no file. Its
        # output connection to an API process that was slow to accept was then lost for good:
        # the process waited for its first answer for ever (CI, 480 s).
        self.listeners = listeners = bind_engine_zmq_listeners(vllm_config, self.count)
        with launch_core_engines(
            vllm_config,
            Executor.get_class(vllm_config),
            not engine_args.disable_log_stats,
            listeners.addresses,
        ) as launch:
            self.engine_manager = launch.engine_manager
            self.coordinator = launch.coordinator
            stats = self.coordinator.get_stats_publish_address() if self.coordinator else None
            self.api = APIServerProcessManager(
                listen_address=listen_address,
                sock=sock,
                args=self.args,
                num_servers=self.count,
                input_listeners=listeners.inputs,
                output_listeners=listeners.outputs,
                target_server_fn=target,
                stats_update_address=stats,
                tensor_queue=launch.tensor_queue,
            )
            launch.watched_frontend_processes = self.api.processes
            # The API processes have the listening socket now (vLLM closes its engine listeners
            # here for the same reason). Kept open here, it would outlive their drain: a
            # connection made after the last of them stopped listening would wait in a backlog
            # nobody accepts from, then be reset when the pod exits (CI: a request sent as the
            # drain began). Closed, it is refused at once and the client goes elsewhere.
            sock.close()
        logger.info("the engine is up for %d API processes", self.count)

    def finished_engines(self) -> dict[str, int]:
        """Engine processes that exited: name -> exit code."""
        finished: dict[str, int] = {}
        if self.engine_manager is not None:
            finished.update(self.engine_manager.finished_procs())
        if self.coordinator is not None and self.coordinator.proc.exitcode is not None:
            finished[self.coordinator.proc.name] = self.coordinator.proc.exitcode
        return finished

    def shutdown(self, timeout: float) -> None:
        """Stop the engine (the API processes are stopped by the caller first)."""
        if self.api is not None:
            self.api.shutdown(timeout=timeout)
        if self.engine_manager is not None:
            self.engine_manager.shutdown(timeout=timeout)
        if self.coordinator is not None:
            self.coordinator.shutdown(timeout=timeout)
        if self.listeners is not None:
            self.listeners.cleanup()
