"""The simulator's engine model: model facts, device profiles, the roofline step time, the KV
cache size, and how the plugin hands the device to the simulator and the facts to the record."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import run_records

from pytest_profllm.sim.config import NoCacheMemory, build_setup, describe_server
from pytest_profllm.sim.cost import SLOWDOWN_ENV, EngineModel, StepWork
from pytest_profllm.sim.hardware import MATMUL_FRACTION, UnknownDevice, device_profile, profiles
from pytest_profllm.sim.models import UnknownModel, known_names, resolve_model
from pytest_profllm.sim.virtual import Request, roofline_throughput, simulate

# Parameter counts as the models' cards state them (billions).
PUBLISHED_PARAMS = {
    "Qwen/Qwen3-0.6B": 0.6,
    "Qwen/Qwen3-8B": 8.2,
    "Qwen/Qwen3-32B": 32.8,
    "meta-llama/Llama-3.1-8B-Instruct": 8.03,
    "meta-llama/Llama-3.3-70B-Instruct": 70.6,
    "meta-llama/Llama-3.1-405B-Instruct": 405.9,
    "mistralai/Mistral-7B-Instruct-v0.3": 7.25,
    "mistralai/Mixtral-8x7B-Instruct-v0.1": 46.7,
    "deepseek-ai/DeepSeek-R1": 671.0,
    "Qwen/Qwen3-235B-A22B-Instruct-2507": 235.0,
    "zai-org/GLM-4.5-Air": 106.0,
    "meta-llama/Llama-2-70b-chat-hf": 69.0,
    "huggyllama/llama-7b": 6.7,
}
# Active parameters per token of the mixtures of experts, as their cards state them.
PUBLISHED_ACTIVE = {
    "Qwen/Qwen3-235B-A22B-Instruct-2507": 22.0,
    "Qwen/Qwen3-30B-A3B": 3.3,
    "zai-org/GLM-4.5-Air": 12.0,
}


@pytest.mark.parametrize(("name", "billions"), PUBLISHED_PARAMS.items())
def test_catalog_facts_give_the_published_parameter_counts(name: str, billions: float) -> None:
    assert resolve_model(name).params / 1e9 == pytest.approx(billions, rel=0.02)


@pytest.mark.parametrize(("name", "billions"), PUBLISHED_ACTIVE.items())
def test_a_mixture_of_experts_computes_with_its_active_parameters(
    name: str, billions: float
) -> None:
    # GLM-4.5-Air's card counts 12B; its shared expert and first dense layer make ours 13.4B.
    assert resolve_model(name).active_params / 1e9 == pytest.approx(billions, rel=0.12)


def test_a_mixture_of_experts_decode_reads_the_experts_its_tokens_hit() -> None:
    moe = _engine("Qwen/Qwen3-30B-A3B")
    facts = moe.model
    kernels = moe.device.overheads

    def reads(tokens: int) -> float:
        # The linear layers' time with compute made negligible: what their weights' bytes take.
        return moe._linear_seconds(tokens, 0, 3.35e12, 1e30, kernels)

    # One token reads its 8 experts of 128 (and the shared part), not every expert's weights;
    # a large batch hits nearly every expert: all the weights, once.
    assert reads(1) < 0.25 * reads(512)
    assert reads(1) / reads(512) == pytest.approx(facts.active_params / facts.params, rel=0.3)


def test_an_fp8_kv_cache_halves_the_bytes_per_token_and_doubles_the_tokens() -> None:
    auto = _engine("meta-llama/Llama-3.1-8B")
    fp8 = EngineModel(auto.model, auto.device, kv_cache_dtype="fp8")
    assert fp8.kv_bytes_per_token == auto.kv_bytes_per_token / 2
    assert fp8.kv_cache_tokens() == pytest.approx(2 * auto.kv_cache_tokens(), rel=0.01)
    served = build_setup("meta-llama/Llama-3.1-8B", kv_cache_dtype="fp8").num_gpu_blocks
    assert served == pytest.approx(
        2 * build_setup("meta-llama/Llama-3.1-8B").num_gpu_blocks, rel=0.01
    )
    long_context = StepWork(decode_seqs=8, decode_context=8 * 20_000)
    assert fp8.step_seconds(long_context) < 0.8 * auto.step_seconds(long_context)


def test_a_host_factor_scales_the_cpu_side_costs_alone() -> None:
    dgx, nebius = (_engine("deepseek-ai/DeepSeek-R1", d, 8) for d in ("H200-DGX", "H200-Nebius"))
    assert (
        dgx.device.source.endswith("h200-dgx.toml")
        and "8480C"
        in Path(Path(__file__).parents[1] / "pytest_profllm" / dgx.device.source).read_text()
    )
    slower = replace(nebius, device=replace(nebius.device, host_cpu_factor=1.5))
    idle = StepWork()
    assert slower.step_seconds(idle) == pytest.approx(1.5 * nebius.step_seconds(idle))
    assert slower.request_seconds() == pytest.approx(1.5 * nebius.request_seconds())
    busy = StepWork(decode_seqs=64, decode_context=64_000)
    assert slower.roofline_seconds(busy) == nebius.roofline_seconds(busy)


def test_new_device_profiles_answer_to_their_names() -> None:
    assert device_profile("AMD Instinct MI300X").memory_bandwidth_gbs == 5300
    assert device_profile("l40").bf16_tflops == 181  # not the L40S's 362
    assert device_profile("dgx-h200").name == "H200-DGX"
    assert device_profile("nebius-h200").name == "H200-Nebius"
    # MI300X's 192 GB hold Llama-2-70B in FP8 on one GPU with room for the cache.
    assert build_setup("amd/Llama-2-70b-chat-hf-FP8", device="MI300X").num_gpu_blocks > 10_000


def test_high_concurrency_reaches_its_roofline_and_more_streams_carry_more() -> None:
    """Qwen3-8B on one H100 SXM, 256 in / 128 out, everything sent at once: 1,000 streams run
    within 20 % of the roofline bound on the profile's own figures, and carry at least what 256
    streams do."""
    engine = _engine()
    got = {
        streams: simulate(engine, [Request(256, 128)] * streams).summary()["output_throughput"]
        for streams in (256, 1000)
    }
    assert got[1000] >= got[256]
    assert got[1000] >= 0.8 * roofline_throughput(engine, 1000, 256, 128)


def test_kv_bytes_active_params_and_dtype() -> None:
    qwen = resolve_model("Qwen/Qwen3-8B")
    assert qwen.kv_bytes_per_token == 36 * 2 * 8 * 128 * 2  # layers, K and V, heads, dim, bf16
    assert qwen.bytes_per_param == 2.0
    assert resolve_model("Qwen/Qwen3-14B-FP8").bytes_per_param == 1.0
    deepseek = resolve_model("deepseek-ai/DeepSeek-R1")
    assert deepseek.active_params / 1e9 == pytest.approx(37, rel=0.03)
    assert deepseek.kv_bytes_per_token == 61 * (512 + 64) * 2  # MLA: the latent and rope part
    assert resolve_model("qwen/qwen3-8b") == qwen  # hub names are case-insensitive


def test_a_local_folder_uses_its_own_config(tmp_path: Path) -> None:
    config = {
        "num_hidden_layers": 4,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1024,
        "vocab_size": 1000,
        "torch_dtype": "float16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    facts = resolve_model(str(tmp_path))
    assert facts.source == str(tmp_path / "config.json")
    assert facts.num_hidden_layers == 4 and facts.kv_bytes_per_token == 4 * 2 * 2 * 64 * 2


def test_an_unknown_model_name_lists_the_known_ones() -> None:
    with pytest.raises(UnknownModel) as error:
        resolve_model("acme/Giant-9000B")
    message = str(error.value)
    assert "model 'acme/Giant-9000B' is not in the simulator's catalog" in message
    assert all(name in message for name in known_names())
    with pytest.raises(UnknownModel):
        build_setup("acme/Giant-9000B")
    # A bare test name (no organisation) is the simulator's own 8B-class model folder.
    assert build_setup("m").engine.model.name == "profllm-sim"


def test_device_profiles_have_their_figures_and_sources() -> None:
    assert {"H100-SXM", "H200", "A100-40GB", "A100-80GB", "L40S", "MI300X", "L40"} <= set(
        profiles()
    )
    for profile in profiles().values():
        text = (Path(__file__).parents[1] / "pytest_profllm" / profile.source).read_text()
        # Each figure says where it comes from; the CPU's are a base `profllm calibrate` fits.
        assert "Datasheet" in text or "profllm calibrate" in text, profile.name
        assert profile.memory_gib > 0 and profile.memory_bandwidth_gbs > 0
    assert device_profile("a100").name == "A100-80GB"
    with pytest.raises(UnknownDevice, match="known devices: A100-40GB, A100-80GB"):
        device_profile("TPU")


def _engine(model: str = "Qwen/Qwen3-8B", device: str = "H100-SXM", tp: int = 1) -> EngineModel:
    return EngineModel(resolve_model(model), device_profile(device), tp)


def _decode(engine: EngineModel, batch: int, context: int = 1000) -> float:
    # emitted=0: the GPU's part alone, without the API server's per-token floor.
    return engine.step_seconds(StepWork(decode_seqs=batch, decode_context=batch * context))


def test_decode_is_bound_by_memory_bandwidth() -> None:
    h100 = _engine()
    weights_s = resolve_model("Qwen/Qwen3-8B").weight_bytes / 3350e9
    assert weights_s < _decode(h100, 1) < 1.5 * weights_s + 0.003
    # More sequences read more KV cache; H200's bandwidth makes each step shorter.
    assert _decode(h100, 64) > _decode(h100, 1)
    assert _decode(_engine(device="H200"), 8) < 0.8 * _decode(h100, 8)
    # FP8 weights: half the bytes to read.
    assert _decode(_engine("Qwen/Qwen3-8B-FP8"), 1) < 0.7 * _decode(h100, 1)
    # A bigger model is slower, in proportion to its weights (past the host's fixed cost).
    host = h100.step_seconds(StepWork())
    ratio = (_decode(_engine("Qwen/Qwen3-32B"), 1) - host) / (_decode(h100, 1) - host)
    assert ratio == pytest.approx(4, rel=0.2)


def test_prefill_is_bound_by_compute() -> None:
    h100, a100 = _engine(), _engine(device="A100-80GB")
    work = StepWork(prefill_tokens=8192, prefill_attended=8192 * 4096.0)
    assert h100.step_seconds(work) > 10 * _decode(h100, 1)
    # 792.1 vs 267.9 measured matmul TFLOP/s, of which a prefill layer reaches 0.65 on the H100
    # (measured there) and 0.50 on the A100 (the fit): about 3.8 times faster, not the 1.6 of
    # their bandwidths.
    assert a100.step_seconds(work) / h100.step_seconds(work) == pytest.approx(3.84, rel=0.15)


def test_matmul_rates_are_the_measured_ones_where_a_measurement_is_known() -> None:
    root = Path(__file__).parents[1] / "pytest_profllm"
    measured = {name for name, p in profiles().items() if p.achieved_bf16_tflops}
    assert {"A100-80GB", "H100-SXM", "H200", "MI300X"} <= measured
    for profile in profiles().values():
        fraction = profile.matmul_flops(False) / profile.peak_flops(False)
        if profile.name in measured:
            # Each measurement names where, on what and when it was taken.
            assert "Measured" in (root / profile.source).read_text(), profile.name
            assert 0.5 < fraction < 1 and fraction == profile.matmul_fraction
        else:
            assert fraction == MATMUL_FRACTION  # the H100 SXM's share, stated as assumed
        # FP8 GEMMs reach the same share of their own peak.
        assert profile.matmul_flops(True) == pytest.approx(profile.peak_flops(True) * fraction)
    # MI300X's datasheet is a third above H100's; its measured matmul rate is not.
    assert device_profile("MI300X").matmul_flops(False) < device_profile("H100").matmul_flops(False)


def test_a_gemm_near_its_ridge_reaches_neither_bound() -> None:
    """With a finite sharpness a step costs the p-norm of its bandwidth and compute times: at
    the ridge more than either, far from it about the larger; the roofline stays a plain max
    and a lower bound."""
    engine = _engine()
    sharp, soft = (
        replace(engine, device=engine.device.with_overheads(roofline_sharpness=p))
        for p in (math.inf, 2.0)
    )

    def linear(engine: EngineModel, tokens: int) -> float:
        bandwidth, flops = engine._achieved_rates(False)
        return engine._linear_seconds(tokens, tokens, bandwidth, flops, engine.device.overheads)

    # Where reading the weights and computing take about as long: sqrt(2) of either.
    ridge = next(t for t in range(16, 4096, 8) if linear(sharp, t) > 1.01 * linear(sharp, 1))
    assert linear(soft, ridge) == pytest.approx(2**0.5 * linear(sharp, ridge), rel=0.1)
    for tokens in (1, 16384):  # far from it, the larger bound alone
        assert linear(soft, tokens) == pytest.approx(linear(sharp, tokens), rel=0.02)
    work = StepWork(decode_seqs=ridge, decode_context=ridge * 500, emitted=ridge)
    assert soft.roofline_seconds(work) == sharp.roofline_seconds(work) < soft.step_seconds(work)


def test_output_processed_after_each_step_adds_to_it() -> None:
    """vLLM before 0.6.0 streamed a step's tokens from the engine's process after the step:
    the frontend's CPU adds to the step instead of overlapping it."""
    overlapped = _engine()
    serial = replace(overlapped, serial_output_processing=True)
    work = StepWork(decode_seqs=64, decode_context=64_000, emitted=64)
    frontend = 64 * overlapped.device.overheads.frontend_token_us / 1e6
    gpu = overlapped.step_seconds(replace(work, emitted=0))
    assert overlapped.step_seconds(work) == pytest.approx(max(gpu, frontend))
    assert serial.step_seconds(work) == pytest.approx(gpu + frontend)


def test_tensor_parallelism_splits_both_and_adds_all_reduces() -> None:
    one, four = (
        _engine("meta-llama/Llama-3.1-70B-Instruct"),
        _engine("meta-llama/Llama-3.1-70B-Instruct", tp=4),
    )
    assert _decode(one, 8) / 4 < _decode(four, 8) < _decode(one, 8) / 2
    prefill = StepWork(prefill_tokens=4096, prefill_attended=4096 * 2048.0)
    assert one.step_seconds(prefill) / 4 < four.step_seconds(prefill) < one.step_seconds(prefill)


def test_the_frontend_floor_and_the_slowdown_factor(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine()
    busy = StepWork(decode_seqs=256, decode_context=256 * 100, emitted=256)
    floor = 256 * engine.device.overheads.frontend_token_us / 1e6
    assert engine.step_seconds(busy) >= floor
    monkeypatch.setenv(SLOWDOWN_ENV, "3")
    slow = build_setup("Qwen/Qwen3-8B").engine
    assert slow.step_seconds(busy) == pytest.approx(3 * engine.step_seconds(busy))
    monkeypatch.setenv(SLOWDOWN_ENV, "-1")
    with pytest.raises(ValueError, match="PROFLLM_SIM_SLOWDOWN='-1': expected a positive"):
        build_setup("Qwen/Qwen3-8B")


def test_kv_cache_follows_memory_utilisation_weights_and_parallelism() -> None:
    small, large = (
        build_setup("Qwen/Qwen3-8B", gpu_memory_utilization=u).num_gpu_blocks for u in (0.5, 0.9)
    )
    assert 0 < small < large
    # About vLLM's figure for Qwen3-8B on one H100 at 0.9: ~54 GiB left, ~390k tokens.
    assert build_setup("Qwen/Qwen3-8B").num_gpu_blocks * 16 == pytest.approx(390_000, rel=0.1)
    with pytest.raises(NoCacheMemory, match="No available memory for the cache blocks"):
        build_setup("meta-llama/Llama-3.3-70B-Instruct")
    assert build_setup("meta-llama/Llama-3.3-70B-Instruct", tensor_parallel_size=4).num_gpu_blocks
    # vLLM's defaults by device: 1024 sequences on H100, 256 on A100.
    assert build_setup("Qwen/Qwen3-8B").max_num_seqs == 1024
    assert build_setup("Qwen/Qwen3-8B", "A100-80GB").max_num_seqs == 256


def test_describe_server_names_device_and_model_facts() -> None:
    described = describe_server({"model": "Qwen/Qwen3-8B", "tensor_parallel_size": 2}, "h200")
    assert described is not None
    assert described["device"]["name"] == "H200"
    assert described["device"]["source"] == "sim/device_profiles/h200.toml"
    assert described["model"]["name"] == "Qwen/Qwen3-8B"
    assert described["model"]["source"] == "catalog"
    assert described["tensor_parallel_size"] == 2
    assert described["kv_cache_tokens"] > 0
    assert describe_server({"model": "acme/none"}, None) is None


def test_the_plugin_passes_the_device_and_records_what_produced_the_figures(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(
        ".yaml",
        bench_device="""
server:
  model: meta-llama/Llama-3.1-8B-Instruct
benchmark:
  num_prompts: 4
  random_input_len: 16
  random_output_len: 4
""",
    )
    result = pytester.runpytest_subprocess(
        f"--profllm-ports={ports}",
        "--profllm-out=results",
        "--profllm-sim-device=a100",
        "--profllm-max-schedule-lag=1000",
        timeout=120,
    )
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    sim = record["engine"]["sim"]
    assert sim["device"]["name"] == "A100-80GB"
    assert sim["model"]["name"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert sim["model"]["params"] == resolve_model("meta-llama/Llama-3.1-8B-Instruct").params
    assert sim["max_num_seqs"] == 256  # vLLM's default on an A100
    (log,) = (pytester.path / "results" / "logs").glob("*.log")
    assert "--sim-device A100-80GB" in log.read_text()
    assert "on 1 x A100-80GB" in log.read_text()


def test_an_unknown_model_fails_its_server_with_the_known_names(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(
        ".yaml",
        bench_unknown="""
server:
  model: acme/Giant-9000B
benchmark:
  num_prompts: 2
""",
    )
    result = pytester.runpytest_subprocess(
        f"--profllm-ports={ports}", "--profllm-out=results", timeout=120
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*exited with code 1 during start-up*", "*model 'acme/Giant-9000B' is not in the*"]
    )


def test_an_mla_latent_is_read_whole_on_every_gpu_and_few_kv_heads_are_replicated() -> None:
    # DeepSeek's MLA cache is one latent per token that every tensor-parallel rank keeps and
    # reads whole; GQA heads split over the GPUs until there are fewer heads than GPUs.
    work = StepWork(decode_seqs=256, decode_context=256 * 4000)
    deepseek = [_engine("deepseek-ai/DeepSeek-R1", "H200", tp) for tp in (4, 8)]
    attention = [e._attention_seconds(work, 4.8e12, 1e20) for e in deepseek]
    assert attention[0] == pytest.approx(attention[1])
    assert attention[0] == pytest.approx(256 * 4000 * deepseek[0].kv_bytes_per_token / 4.8e12)
    # Qwen3-235B has 4 KV heads: at tp 8 each GPU still holds (and reads) a whole head.
    qwen = [_engine("Qwen/Qwen3-235B-A22B", "H100-SXM", tp) for tp in (2, 4, 8)]
    reads = [e._attention_seconds(work, 3.35e12, 1e20) for e in qwen]
    assert reads[0] == pytest.approx(2 * reads[1]) and reads[1] == pytest.approx(reads[2])
    assert [e.kv_cache_tokens() for e in qwen][2] > 0


def test_routed_experts_compute_each_experts_tokens_padded_to_the_kernel_block() -> None:
    # DeepSeek-R1 (256 experts, top 8) at tp 8, bandwidth made huge so compute alone counts:
    # 1,000 decoding tokens give each expert about 31, and fused_moe's 64-row block computes
    # about twice their FLOPs; a prefill chunk of 8,192 (256 an expert) pays half a block more.
    engine = _engine("deepseek-ai/DeepSeek-R1", "H200", 8)
    kernels = replace(engine.device.overheads, moe_efficiency=1.0)
    facts = engine.model
    expert = 3 * facts.hidden_size * facts.moe_intermediate_size
    expert *= facts.num_hidden_layers - facts.first_dense_layers

    def padding(tokens: int) -> float:
        """The seconds the blocks add, over the seconds of the tokens' own routed FLOPs."""
        blocks = engine._linear_seconds(tokens, 0, 1e18, 1e15, kernels)
        tokens_only = engine._linear_seconds(tokens, 0, 1e18, 1e15, None)
        own = 2.0 * tokens * facts.num_experts_per_tok * expert / 8 / 1e15
        return (blocks - tokens_only) / own

    assert padding(1000) == pytest.approx(64 / 31.25 - 1, rel=0.02)
    assert padding(8192) == pytest.approx(32 / 256, rel=0.02)


# vLLM's own kernel benchmark of its Triton fused_moe with DeepSeek-V3's block-FP8 experts on
# one H100 (benchmarks/kernels/benchmark_moe.py, vLLM PR #13932, 2025-02-26): microseconds per
# MoE layer by tensor-parallel size and tokens. DeepSeek-R1 has the same expert shapes.
FUSED_MOE_H100_US = {
    (8, 128): 1732.33, (8, 1024): 1892.75, (8, 2048): 2818.65,
    (1, 128): 12480.49, (1, 1536): 13777.98, (1, 2048): 19839.38,
}  # fmt: skip


@pytest.mark.parametrize(("tp", "tokens"), FUSED_MOE_H100_US)
def test_routed_experts_take_about_what_vllms_kernel_benchmark_measured(
    tp: int, tokens: int
) -> None:
    """The routed-expert term, fitted on whole serving runs only, against a kernel timing it
    never saw, at decode batches (bandwidth-bound) and prefill chunks alike: 0.65 to 1.15 of
    the measured times with the shipped overheads."""
    engine = _engine("deepseek-ai/DeepSeek-R1", "H100-SXM", tp)
    bandwidth, flops = engine._achieved_rates(True)
    modelled = engine._expert_layer_seconds(tokens, bandwidth, flops, engine.device.overheads)
    assert modelled * 1e6 == pytest.approx(FUSED_MOE_H100_US[(tp, tokens)], rel=0.4)


def test_a_deep_model_config_is_one_line_naming_it(tmp_path: Path) -> None:
    # Deeper than limits.py allows. Once: a RecursionError from the simulator's start.
    (tmp_path / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError) as caught:
        resolve_model(str(tmp_path))
    assert str(caught.value) == f"{tmp_path / 'config.json'} nests JSON deeper than 64 levels"


def test_online_fp8_quantization_makes_the_weights_fp8_and_the_record_says_so() -> None:
    # vLLM's --quantization fp8 on a 16-bit checkpoint: FP8 weights, quicker memory-bound
    # decode steps; and the record's engine.sim names the quantization and the KV cache dtype.
    plain = build_setup("Qwen/Qwen3-8B")
    fp8 = build_setup("Qwen/Qwen3-8B", quantization="fp8")
    assert fp8.engine.model.weight_bytes == pytest.approx(plain.engine.model.weight_bytes / 2,
                                                          rel=0.05)
    work = StepWork(decode_seqs=16, decode_context=16 * 512)
    assert fp8.engine.step_seconds(work) < plain.engine.step_seconds(work)
    described = describe_server(
        {"model": "Qwen/Qwen3-8B", "quantization": "fp8", "kv_cache_dtype": "fp8"}, None)
    assert described is not None
    assert described["model"]["quantization"] == "fp8"
    assert described["kv_cache_dtype"] == "fp8"
