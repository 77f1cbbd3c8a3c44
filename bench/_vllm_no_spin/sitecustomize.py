"""Experiment only (bench/vllm_spin_repro.py --no-spin): vLLM's shared-memory message queues
with no busy loop. Put on PYTHONPATH, this runs in every Python process of the server (the API
process, the engine core and its workers, spawned with this environment) and, once vLLM's
shm_broadcast module is imported, makes every SpinCondition wait on its ZeroMQ notification at
once instead of spinning with sched_yield() for busy_loop_s (1 s) after each message."""

import importlib.abc
import importlib.util
import sys

_TARGET = "vllm.distributed.device_communicators.shm_broadcast"


class _Patch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        sys.meta_path.insert(0, self)
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        original = module.SpinCondition.__init__

        def no_busy_loop(self, is_reader, context, notify_address, busy_loop_s=1):
            original(self, is_reader, context, notify_address, busy_loop_s=0)

        module.SpinCondition.__init__ = no_busy_loop


sys.meta_path.insert(0, _Patch())
