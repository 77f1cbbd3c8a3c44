"""A group worker's engine: vLLM's headless launch, in a process of its own.

``vllm.entrypoints.cli.serve.run_headless`` runs this node's part of the group -- the mp
executor's workers of an engine spanning nodes (``--node-rank`` > 0), or whole data-parallel
engines that report to the leader's API server (``--data-parallel-start-rank``) -- and blocks
until they end. It runs in a spawned child so the runtime's own process stays free to answer
probes and to keep the group's liveness channel (group.py); the child dies with it.
"""

from __future__ import annotations

import multiprocessing
import os
from argparse import Namespace
from multiprocessing.process import BaseProcess

from llmendpoints_runtime.proctree import die_with_parent


def start_headless(args: Namespace) -> BaseProcess:
    """Start vLLM's headless launch of ``args`` (vLLM's parsed serve arguments, --headless
    among them) in a spawned child; returns it, started."""
    process = multiprocessing.get_context("spawn").Process(
        target=_run_headless, args=(args, os.getpid()), name="llmep-headless-engine"
    )
    process.start()
    return process


def _run_headless(args: Namespace, parent: int) -> None:
    # SIGTERM when the runtime dies, however it dies (vLLM's own workers watch this process).
    if not die_with_parent(parent):
        return
    from vllm.entrypoints.cli.serve import run_headless

    args.api_server_count = 0  # what `vllm serve --headless` sets before it gets here
    run_headless(args)
