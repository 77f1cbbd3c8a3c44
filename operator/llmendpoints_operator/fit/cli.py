"""`llmendpoints-operator fit`: the operator's fit check, run locally before anything is applied.

    llmendpoints-operator fit MODEL --gpus N [--nodes N] --gpu-memory 80GiB [--max-model-len ...]
                              [--tensor-parallel-size ...] [--kv-cache-dtype fp8] [--json] ...

MODEL is a model on a hub (HF_ENDPOINT, else https://huggingface.co; HF_TOKEN for private and
gated models) or a local folder with config.json and *.safetensors. Only config.json and the
safetensors headers are read. The answer is the one the operator writes into ModelFits and
status.fit for the same settings (the same spec parsing, the same check). Exit status: 0 fits,
1 does not fit, 3 cannot tell (the message says why), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from llmendpoints_operator.fit.inputs import fit_inputs, quantity_bytes
from llmendpoints_operator.fit.local import read_folder
from llmendpoints_operator.fit.safetensors import HeaderError
from llmendpoints_operator.fit.sizing import GpuMemory, ModelFacts
from llmendpoints_operator.fit.verdict import Fit, assess, unknown
from llmendpoints_operator.hub import DEFAULT_HUB, HubClient, HubError
from llmendpoints_operator.spec import InvalidSpecError, parse

EXIT = {"True": 0, "False": 1, "Unknown": 3}
# CLI option -> the engine flag it sets through spec.engine.args.
ENGINE_ARGS = ("kv-cache-dtype", "max-num-seqs", "max-num-batched-tokens")


def add_parser(commands: Any) -> None:
    fit = commands.add_parser(
        "fit",
        help="will a model fit these GPUs? (the operator's pre-flight check, locally)",
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 fits, 1 does not fit, 3 cannot tell, 2 bad arguments. "
        "HF_ENDPOINT and HF_TOKEN are read as huggingface_hub reads them.",
    )
    fit.add_argument("model", help="a model on the hub (org/name), or a local folder")
    fit.add_argument("--gpus", type=int, default=1, help="GPUs per node (default 1)")
    fit.add_argument("--nodes", type=int, default=1, help="nodes per replica (default 1)")
    fit.add_argument("--gpu-memory", required=True, help="memory of one GPU, e.g. 80GiB or 24Gi")
    fit.add_argument("--gpu-product", help="the GPU's name, for the message and batch defaults")
    fit.add_argument("--gpus-per-node", type=int, help="for suggestions of more GPUs (default 8)")
    fit.add_argument("--revision", help="branch, tag or commit (default main)")
    fit.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    fit.add_argument("--tensor-parallel-size", type=int, help="default: the GPUs left")
    fit.add_argument("--pipeline-parallel-size", type=int, help="default: --nodes or 1")
    fit.add_argument("--data-parallel-size", type=int, help="default 1")
    fit.add_argument("--enable-expert-parallel", action="store_true", help="vLLM's flag")
    fit.add_argument("--gpu-memory-utilization", type=float, help="default 0.9")
    fit.add_argument("--dtype", help="auto, bfloat16, float16, float32 (default auto)")
    fit.add_argument("--quantization", help="e.g. fp8 (default: the checkpoint's)")
    for flag in ENGINE_ARGS:
        fit.add_argument(f"--{flag}", help=f"vLLM's --{flag}")
    fit.add_argument("--json", action="store_true", help="print the answer as JSON")


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    engine: dict[str, Any] = {
        "maxModelLen": args.max_model_len,
        "tensorParallelSize": args.tensor_parallel_size,
        "pipelineParallelSize": args.pipeline_parallel_size,
        "dataParallelSize": args.data_parallel_size,
        "enableExpertParallel": args.enable_expert_parallel or None,
        "gpuMemoryUtilization": args.gpu_memory_utilization,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "args": {
            flag: getattr(args, flag.replace("-", "_"))
            for flag in ENGINE_ARGS
            if getattr(args, flag.replace("-", "_")) is not None
        },
    }
    return {
        "model": {"name": args.model, "revision": args.revision},
        "engine": {k: v for k, v in engine.items() if v is not None},
        "resources": {
            "gpus": args.gpus,
            "nodes": args.nodes,
            "gpuMemory": quantity_bytes(args.gpu_memory),
        },
    }


async def _facts(model: str, revision: str | None) -> ModelFacts:
    if Path(model).expanduser().is_dir():
        return read_folder(Path(model).expanduser())
    hub = HubClient(timeout=30)
    try:
        files = await hub.model(
            os.environ.get("HF_ENDPOINT") or DEFAULT_HUB,
            model,
            revision,
            os.environ.get("HF_TOKEN"),
        )
    finally:
        await hub.close()
    return ModelFacts(files.config, files.tensors, files.commit, files.url)


async def check(args: argparse.Namespace) -> Fit:
    from llmendpoints_operator.engine_flags import check as check_flags

    ep = parse("fit", "local", _spec(args))
    if problems := check_flags(ep):
        raise InvalidSpecError(problems)
    memory = quantity_bytes(args.gpu_memory)
    gpu = GpuMemory(memory, args.gpu_product, "--gpu-memory", args.gpus_per_node)
    try:
        facts = await _facts(args.model, args.revision)
    except HubError as exc:
        return unknown("HubError", str(exc))
    except (OSError, ValueError, HeaderError) as exc:
        return unknown("ModelUnreadable", str(exc))
    return assess(facts, fit_inputs(ep), gpu)


def _print(fit: Fit, as_json: bool) -> None:
    if as_json:
        payload = {"status": fit.status, "reason": fit.reason, "message": fit.message}
        print(json.dumps({**payload, "fit": dict(fit.numbers or {})}, indent=2))
        return
    print(f"ModelFits: {fit.status} ({fit.reason})")
    print(f"  {fit.message}")
    for key, value in (fit.numbers or {}).items():
        shown = f"{value:,}" if isinstance(value, int) else value
        print(f"  {key:<24} {shown}")


def main(args: argparse.Namespace) -> int:
    try:
        fit = asyncio.run(check(args))
    except (InvalidSpecError, ValueError) as exc:
        print(f"llmendpoints-operator fit: {exc}", file=sys.stderr)
        return 2
    _print(fit, args.json)
    return EXIT[fit.status]
