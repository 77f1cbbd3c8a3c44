"""The fit check's pure parts: vLLM's arithmetic on real models' shapes, checked by hand.

(tests/runtime/test_fit_estimate.py checks the same code against vLLM's CPU build; tests/
integration/test_fit_check.py runs it in the operator.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import model_shapes
import pytest
from llmendpoints_operator.fit import architecture, kvcache, nodes, overhead, weights
from llmendpoints_operator.fit.inputs import defaults, fit_inputs, quantity_bytes
from llmendpoints_operator.fit.safetensors import HeaderError, header_length, parse_header
from llmendpoints_operator.fit.sizing import GpuMemory, ModelFacts, size
from llmendpoints_operator.fit.verdict import assess
from llmendpoints_operator.fit.weights import Parallelism
from llmendpoints_operator.spec import parse

MiB, GiB = 1 << 20, 1 << 30
H100 = GpuMemory(81559 * MiB, "NVIDIA-H100-80GB-HBM3", "node labels", 8)
L4 = GpuMemory(23034 * MiB, "NVIDIA-L4", "node labels", 1)


def _facts(config: dict[str, Any], shards: int) -> ModelFacts:
    tensors = []
    for file, ts in model_shapes.shards(model_shapes.llama_tensors(config), shards).items():
        header = model_shapes.header(ts)
        tensors += parse_header(header[8 : 8 + header_length(header[:8], file)], file)
    return ModelFacts(config, tuple(tensors), "abc", "hub")


LLAMA_70B = _facts(model_shapes.LLAMA_3_70B, 30)
LLAMA_8B = _facts(model_shapes.LLAMA_31_8B, 4)


def _assess(facts: ModelFacts, gpu: GpuMemory, **spec: Any):
    raw = {"model": {"name": "org/m"}, **spec}
    return assess(facts, fit_inputs(parse("e", "ns", raw)), gpu)


# --- safetensors headers --------------------------------------------------------------------


def test_a_header_gives_every_tensor_with_its_exact_bytes() -> None:
    header = model_shapes.header([("a", "BF16", [3, 4]), ("b", "F32", [5])])
    tensors = parse_header(header[8 : 8 + header_length(header[:8], "f")], "f")
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in tensors] == [
        ("a", "BF16", (3, 4), 24),
        ("b", "F32", (5,), 20),
    ]
    assert sum(t.nbytes for t in LLAMA_70B.tensors) == model_shapes.LLAMA_3_70B_TOTAL


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"\x00" * 8, "header length 0"),
        (b"\xff" * 8, "is not a safetensors header"),
        (b"\x01", "where the 8-byte header length should be"),
    ],
)
def test_a_bad_length_is_refused(data: bytes, says: str) -> None:
    with pytest.raises(HeaderError, match=says):
        header_length(data, "f")


@pytest.mark.parametrize("text", [b"not json", b"[1]", b'{"t": {"dtype": "F16", "shape": [2]}}'])
def test_a_bad_header_is_refused(text: bytes) -> None:
    with pytest.raises(HeaderError, match=r"^f: "):
        parse_header(text, "f")


# --- config.json ----------------------------------------------------------------------------


def _config(**changes: Any) -> dict[str, Any]:
    return {**model_shapes.LLAMA_31_8B, **changes}


@pytest.mark.parametrize(
    ("changes", "windows"),
    [
        ({}, (None,) * 4),  # Llama: full attention
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, (4096,) * 4),
        ({"architectures": ["Gemma2ForCausalLM"], "sliding_window": 4096}, (4096, None) * 2),
        (
            {"architectures": ["Gemma3ForCausalLM"], "sliding_window": 512},
            (512, 512, 512, 512),  # 5 local : 1 global, the first global is layer 5
        ),
        (  # Qwen: sliding_window is ignored without use_sliding_window (transformers)
            {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 32768},
            (None,) * 4,
        ),
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "sliding_window": 32768,
                "use_sliding_window": True,
                "max_window_layers": 2,
            },
            (None, None, 32768, 32768),
        ),
        (
            {"sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 2},
            (128, None, 128, None),
        ),
    ],
)
def test_sliding_windows_per_layer_as_vllm_builds_them(changes: dict, windows: tuple) -> None:
    shape = architecture.read_config(_config(num_hidden_layers=4, **changes))
    assert shape.windows == windows


def test_deepseek_mla_caches_one_latent_per_token_and_layer() -> None:
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
        "torch_dtype": "bfloat16",
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
    }
    shape = architecture.read_config(config)
    assert shape.mla_dim == 576
    assert kvcache.model_bytes_per_token(shape, 2) == 61 * 576 * 2
    # the latent is the same on every tensor-parallel rank (not split by heads)
    assert kvcache.token_bytes_per_layer(shape, 2, tensor=8) == 576 * 2
    assert shape.max_position == 163840  # yarn: already the scaled length


def test_the_longest_context_is_vllms() -> None:
    assert architecture.read_config(_config()).max_position == 131072  # llama3 rope: as given
    linear = _config(max_position_embeddings=4096, rope_scaling={"type": "linear", "factor": 4})
    assert architecture.read_config(linear).max_position == 16384


def test_an_architecture_the_check_does_not_know_is_unknown_with_the_reason() -> None:
    with pytest.raises(architecture.UnknownModel, match="architecture MambaForCausalLM"):
        architecture.read_config(_config(architectures=["MambaForCausalLM"]))
    with pytest.raises(architecture.UnknownModel, match="layer_types"):
        architecture.read_config(_config(layer_types=["linear_attention"] * 32))


def test_float32_checkpoints_run_in_bfloat16() -> None:
    shape = architecture.read_config(_config(torch_dtype="float32"))
    assert architecture.model_dtype(shape, None) == ("bfloat16", 2)
    assert architecture.model_dtype(shape, "float32") == ("float32", 4)


# --- weights per GPU ------------------------------------------------------------------------


SHAPE_70B = architecture.read_config(model_shapes.LLAMA_3_70B)
NORMS_70B = sum(t.nbytes for t in LLAMA_70B.tensors if len(t.shape) == 1)


def test_tensor_parallel_splits_matrices_and_keeps_norms_whole() -> None:
    (per_gpu,) = weights.per_stage(LLAMA_70B.tensors, SHAPE_70B, Parallelism(tensor=4), 2)
    assert per_gpu == (model_shapes.LLAMA_3_70B_TOTAL - NORMS_70B) // 4 + NORMS_70B


def test_beyond_the_kv_heads_ranks_hold_copies_of_k_and_v() -> None:
    (split16,) = weights.per_stage(LLAMA_70B.tensors, SHAPE_70B, Parallelism(tensor=16), 2)
    kv = sum(t.nbytes for t in LLAMA_70B.tensors if "k_proj" in t.name or "v_proj" in t.name)
    rest = model_shapes.LLAMA_3_70B_TOTAL - kv - NORMS_70B
    assert split16 == rest // 16 + kv // 8 + NORMS_70B  # 8 KV heads: split 8 ways, not 16


def test_pipeline_stages_take_their_layers_and_the_ends_their_embeddings() -> None:
    assert weights.stage_layers(80, 2) == [range(0, 40), range(40, 80)]
    assert weights.stage_layers(10, 4) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    first, last = weights.per_stage(LLAMA_70B.tensors, SHAPE_70B, Parallelism(pipeline=2), 2)
    embed = 128256 * 8192 * 2
    assert first - embed == last - embed - 8192 * 2  # the final norm on the last stage
    assert first + last == model_shapes.LLAMA_3_70B_TOTAL


def test_online_fp8_halves_the_linear_layers() -> None:
    shape = architecture.read_config(model_shapes.LLAMA_31_8B)
    (bf16,) = weights.per_stage(LLAMA_8B.tensors, shape, Parallelism(), 2)
    (fp8,) = weights.per_stage(LLAMA_8B.tensors, shape, Parallelism(), 2, online_fp8=True)
    assert 0.5 < fp8 / bf16 < 0.6  # the embedding and LM head stay in bfloat16


# --- the KV cache ---------------------------------------------------------------------------


def test_70b_holds_327680_bytes_of_kv_cache_per_token() -> None:
    assert kvcache.model_bytes_per_token(SHAPE_70B, 2) == 2 * 80 * 8 * 128 * 2 == 327_680


def test_hybrid_models_are_grouped_as_vllm_groups_them() -> None:
    gemma = architecture.read_config(
        _config(architectures=["Gemma3ForCausalLM"], sliding_window=512, num_hidden_layers=12)
    )
    kv = kvcache.layout(gemma, 2, 1, 16)
    # 10 local + 2 global layers: groups of 2 layers, 5 local groups and 1 global
    assert [len(g) for g in kv.groups] == [2] * 6
    assert kv.windows == (512,) * 5 + (None,)
    assert kvcache.bytes_per_block(kv, range(12)) == 2 * kv.page_bytes
    blocks = kvcache.blocks_per_request(kv, max_len=8192, in_flight=2048)
    assert blocks == 5 * (-(-(511 + 2048) // 16) + 1) + 8192 // 16
    balanced = architecture.read_config(
        _config(sliding_window=128, num_hidden_layers=25,
                layer_types=["sliding_attention", "full_attention"] * 12 + ["full_attention"])
    )  # fmt: skip
    # 12 sliding and 13 full: under 1.5x, so one group of 13 each (the padding is smaller)
    assert [len(g) for g in kvcache.layout(balanced, 2, 1, 16).groups] == [12, 13]


def test_tokens_and_concurrency_are_vllms_formulas() -> None:
    kv = kvcache.layout(SHAPE_70B, 2, 4, 16)
    stages = [range(80)]
    per_block = kvcache.bytes_per_block(kv, stages[0])
    assert per_block == 80 * 16 * 2 * 128 * 2 * 2  # 80 layers x 16 tokens x 2 KV heads (8/4)
    plan = kvcache.plan(kv, stages, [1000 * per_block + 5], max_len=8000, in_flight=8192)
    assert plan.blocks == 1000
    assert plan.concurrency == 1000 / 500
    assert plan.tokens == 16000
    assert plan.fits and plan.longest == 8000
    short = kvcache.plan(kv, stages, [400 * per_block], max_len=8000, in_flight=8192)
    assert not short.fits
    assert short.longest == 399 * 16  # every block but the null block


# --- the reserve ----------------------------------------------------------------------------


def test_batch_defaults_and_capture_sizes_are_vllms() -> None:
    assert overhead.batch_defaults(80 * GiB, "NVIDIA-H100-80GB-HBM3") == (1024, 8192)
    assert overhead.batch_defaults(80 * GiB, "NVIDIA-A100-SXM4-80GB") == (256, 2048)
    assert overhead.batch_defaults(24 * GiB, "NVIDIA-L4") == (256, 2048)
    assert overhead.batch_defaults(192 * GiB, "NVIDIA-B200") == (1024, 16384)
    sizes = overhead.capture_sizes(256, 2048)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512 and len(sizes) == 51


# --- nodes ----------------------------------------------------------------------------------


def _node(name: str, labels: dict[str, str], gpus: int = 8, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}},
    }


H100_LABELS = {nodes.PRODUCT: "NVIDIA-H100-80GB-HBM3", nodes.MEMORY: "81559", "pool": "h100"}
L4_LABELS = {nodes.PRODUCT: "NVIDIA-L4", nodes.MEMORY: "23034", "pool": "l4"}
TAINT = [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]


def _placement(**changes: Any) -> nodes.Placement:
    plain = nodes.Placement("nvidia.com/gpu", 1, {}, None, [])
    return dataclasses.replace(plain, **changes)


def test_the_smallest_gpu_among_the_nodes_the_pods_may_use_is_the_one_that_counts() -> None:
    cluster = [_node("h", H100_LABELS), _node("l", L4_LABELS, gpus=1)]
    anywhere = nodes.gpus(cluster, _placement())
    assert (anywhere.memory, anywhere.product, anywhere.nodes) == (23034 * MiB, "NVIDIA-L4", 2)
    only_h100 = nodes.gpus(cluster, _placement(node_selector={"pool": "h100"}))
    assert only_h100.memory == 81559 * MiB and only_h100.per_node == 8
    four = nodes.gpus(cluster, _placement(gpus=4))  # the L4 node has one GPU: not eligible
    assert four.memory == 81559 * MiB


@pytest.mark.parametrize(
    ("affinity_term", "eligible"),
    [
        ({"key": "pool", "operator": "In", "values": ["h100"]}, {"h"}),
        ({"key": "pool", "operator": "NotIn", "values": ["h100"]}, {"l"}),
        ({"key": "zone", "operator": "Exists"}, {"l"}),
        ({"key": "zone", "operator": "DoesNotExist"}, {"h"}),
        ({"key": "gen", "operator": "Gt", "values": ["8"]}, {"h"}),
    ],
)
def test_required_node_affinity(affinity_term: dict, eligible: set[str]) -> None:
    cluster = [_node("h", {**H100_LABELS, "gen": "9"}), _node("l", {**L4_LABELS, "zone": "a"})]
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [affinity_term]}]
            }
        }
    }
    where = _placement(affinity=affinity)
    assert {n["metadata"]["name"] for n in cluster if nodes.eligible(n, where)} == eligible


def test_taints_need_tolerations_and_cordoned_nodes_are_left_out() -> None:
    cluster = [_node("h", H100_LABELS, taints=TAINT), _node("x", L4_LABELS, unschedulable=True)]
    assert nodes.gpus(cluster, _placement()).nodes == 0
    for toleration in (
        {"key": "nvidia.com/gpu", "operator": "Exists"},
        {"key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoSchedule"},
        {"operator": "Exists"},
    ):
        assert nodes.gpus(cluster, _placement(tolerations=[toleration])).nodes == 1
    wrong = {"key": "nvidia.com/gpu", "operator": "Equal", "value": "absent"}
    assert nodes.gpus(cluster, _placement(tolerations=[wrong])).nodes == 0


def test_nodes_without_the_memory_label_give_no_memory() -> None:
    found = nodes.gpus([_node("f", {nodes.PRODUCT: "NVIDIA-Future"})], _placement())
    assert (found.memory, found.nodes, found.unlabelled) == (None, 1, 1)


# --- the verdict ----------------------------------------------------------------------------


def test_70b_on_one_h100_does_not_fit_and_says_what_to_change() -> None:
    fit = _assess(LLAMA_70B, H100)
    assert (fit.status, fit.reason) == ("False", "WeightsDoNotFit")
    assert "the weights need 131.4 GiB per GPU, more than the 71.7 GiB vLLM may use" in fit.message
    assert "spec.resources.gpus: 2 with spec.engine.tensorParallelSize: 2" in fit.message


def test_70b_on_four_h100s_fits() -> None:
    fit = _assess(LLAMA_70B, H100, resources={"gpus": 4}, engine={"tensorParallelSize": 4})
    assert fit.status == "True"
    assert fit.numbers["kvCacheBytesPerToken"] == 327_680
    assert fit.numbers["weightsBytes"] == model_shapes.LLAMA_3_70B_TOTAL
    assert fit.numbers["maxConcurrentSequences"] == fit.numbers["kvCacheTokens"] // 8192


def test_8b_at_131072_on_an_l4_is_refused_naming_max_model_len() -> None:
    fit = _assess(LLAMA_8B, L4, engine={"maxModelLen": 131072})
    assert (fit.status, fit.reason) == ("False", "ContextDoesNotFit")
    longest = int(fit.message.split("spec.engine.maxModelLen: ")[1].split(" ")[0].replace(",", ""))
    assert 20_000 < longest < 40_000
    assert _assess(LLAMA_8B, L4, engine={"maxModelLen": longest}).status == "True"
    # Just beyond it, only the estimated reserve stands in the way: not refused on a guess.
    near = _assess(LLAMA_8B, L4, engine={"maxModelLen": longest + 512})
    assert (near.status, near.reason) == ("Unknown", "Borderline")
    assert "fits only if vLLM reserves less than the estimated" in near.message


def test_an_fp8_kv_cache_is_suggested_when_it_would_fit() -> None:
    fit = _assess(LLAMA_8B, L4, engine={"maxModelLen": 50_000})
    assert "spec.engine.args: {kv-cache-dtype: fp8}" in fit.message
    fp8 = _assess(LLAMA_8B, L4, engine={"maxModelLen": 50_000, "args": {"kv-cache-dtype": "fp8"}})
    assert fp8.status == "True" and fp8.numbers["kvCacheDtype"] == "fp8"


def test_what_vllm_would_refuse_at_start_up_is_refused_here() -> None:
    heads = _assess(LLAMA_8B, H100, resources={"gpus": 3}, engine={"tensorParallelSize": 3})
    assert (heads.status, heads.reason) == ("False", "InvalidParallelism")
    assert "choose one of 1, 2, 4, 8, 16, 32" in heads.message
    long = _assess(LLAMA_70B, H100, resources={"gpus": 8}, engine={"maxModelLen": 100_000})
    assert "longer than the model's 8,192 tokens" in long.message


def test_what_the_check_cannot_size_is_unknown_with_why() -> None:
    draft = _assess(LLAMA_8B, H100, engine={"args": {"speculative-config": '{"model": "d"}'}})
    assert (draft.status, draft.reason) == ("Unknown", "SettingUnknown")
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    assert _assess(LLAMA_8B, H100, engine={"args": {"speculative-config": ngram}}).status == "True"
    quantized = _assess(LLAMA_8B, H100, engine={"quantization": "bitsandbytes"})
    assert (quantized.status, quantized.reason) == ("Unknown", "ModelUnknown")


def test_the_kv_cache_budget_flag_replaces_the_profiled_budget() -> None:
    inputs = defaults(kv_cache_memory_bytes=GiB, max_model_len=8192)
    shape = architecture.read_config(model_shapes.LLAMA_31_8B)
    sized = size(shape, LLAMA_8B.tensors, inputs, L4)
    assert sized.kv_memory == GiB
    assert sized.plan.blocks == GiB // (16 * 131072)


@pytest.mark.parametrize(
    ("text", "value"),
    [("80Gi", 80 * GiB), ("80GiB", 80 * GiB), ("81559Mi", 81559 * MiB), ("80G", 80 * 10**9),
     ("24GB", 24 * 10**9), ("8e10", 8 * 10**10), (25769803776, 24 * GiB)],
)  # fmt: skip
def test_memory_quantities(text: Any, value: int) -> None:
    assert quantity_bytes(text) == value


def test_a_bad_memory_quantity_says_so() -> None:
    with pytest.raises(ValueError, match="'lots' is not an amount of memory"):
        quantity_bytes("lots")
