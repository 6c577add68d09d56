"""Published vLLM runs the engine model is fitted on and checked against.

The rows of `shared/data/published-vllm-benchmarks.md` (rows 1-36, sources S1-S8) and
`published-vllm-benchmarks-2.md` (rows 101-129, sources N1-N9), numbers as their sources state
them, each replayed on the virtual clock (`virtual.py`) with the same model, device, host,
parallelism, workload and load. ShareGPT prompts are not shipped: a ShareGPT-like workload
draws lengths from log-normal distributions whose means are the published corpus's (1000
prompts = 217,393 input tokens and about 202 output tokens each for Qwen, row 11; a row that
states its own totals uses those), truncated as vLLM's sample filter does (prompt <= 1024,
prompt + output <= 2048 tokens).

The rows a source marks as low trust (numbers from prose, an unnamed model variant, a GPU
count the post contradicts) are kept apart: printed, never fitted on nor counted in the
error figures.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from dataclasses import dataclass, field, replace
from multiprocessing.pool import Pool

from pytest_profllm.sim import fit_records
from pytest_profllm.sim.cost import EngineModel
from pytest_profllm.sim.fit_records import Fit, HeldOut, Observation
from pytest_profllm.sim.hardware import device_profile
from pytest_profllm.sim.models import resolve_model
from pytest_profllm.sim.virtual import Outcome, Request, ServerSettings, simulate

SHAREGPT_MEAN_INPUT = 217.0
SHAREGPT_MEAN_OUTPUT = 202.0


def sharegpt_like(
    count: int,
    seed: int = 0,
    mean_input: float = SHAREGPT_MEAN_INPUT,
    mean_output: float = SHAREGPT_MEAN_OUTPUT,
) -> list[Request]:
    """ShareGPT-shaped lengths: heavy-tailed log-normals (medians about 60 % of the means)
    with the corpus's means, filtered as vLLM's ShareGPT sampler filters."""
    rng = random.Random(seed)
    requests: list[Request] = []
    s_in, s_out = 1.0, 0.9
    mu_in = math.log(mean_input) - s_in**2 / 2
    mu_out = math.log(mean_output) - s_out**2 / 2
    while len(requests) < count:
        prompt = max(4, int(rng.lognormvariate(mu_in, s_in)))
        output = max(4, int(rng.lognormvariate(mu_out, s_out)))
        if prompt > 1024 or prompt + output > 2048:
            continue  # vLLM's ShareGPT sampler drops these
        requests.append(Request(prompt, output))
    return requests


def random_lengths(
    count: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[Request]:
    """vLLM's random dataset: lengths uniform within +-range_ratio of the asked ones."""
    if not range_ratio:
        return [Request(input_len, output_len) for _ in range(count)]
    rng = random.Random(seed)

    def draw(length: int) -> int:
        low, high = int(length * (1 - range_ratio)), int(length * (1 + range_ratio))
        return max(1, rng.randint(low, high))

    return [Request(draw(input_len), draw(output_len)) for _ in range(count)]


@dataclass(frozen=True)
class Row:
    number: int  # the row's number in its published-vllm-benchmarks file
    source: str  # the file's source label (S1-S8, N1-N9): the unit of cross-validation
    device: str  # a device profile (its host where the source names it)
    model: str
    tp: int
    workload: str  # "sharegpt", or "random IN/OUT" with an optional " rR" range ratio
    num_prompts: int
    request_rate: float = math.inf
    max_concurrency: int | None = None
    # Published figures (None: not given).
    output_throughput: float | None = None
    total_throughput: float | None = None  # compared where output throughput is not given
    median_tpot_ms: float | None = None
    median_itl_ms: float | None = None  # compared with TPOT where TPOT is not given
    settings: ServerSettings = field(default_factory=ServerSettings)
    kv_cache_dtype: str = "auto"
    data_parallel: int = 1  # replicas behind the load: one is simulated with its share
    # ShareGPT totals the row states (mean tokens per prompt), else the corpus's.
    sharegpt_means: tuple[float, float] = (SHAREGPT_MEAN_INPUT, SHAREGPT_MEAN_OUTPUT)
    low_trust: str = ""  # why the row is kept apart ("" : trusted)
    # Why a published TPOT is not vLLM bench serve's and is not compared ("": it is).
    tpot_not_comparable: str = ""

    @property
    def v0(self) -> bool:
        """Run on vLLM's V0 engine (before 0.8), whose API server streamed tokens from the
        engine's own process: its CPU per token is fitted apart from V1's, which we serve."""
        return self.source in V0_SOURCES

    def requests(self) -> list[Request]:
        count = self.num_prompts // self.data_parallel
        if self.workload == "sharegpt":
            return sharegpt_like(count, self.number, *self.sharegpt_means)
        parts = self.workload.split()
        in_len, out_len = (int(part) for part in parts[1].split("/"))
        ratio = float(parts[2][1:]) if len(parts) > 2 else 0.0
        return random_lengths(count, in_len, out_len, ratio, seed=self.number)

    def engine(self) -> EngineModel:
        device = device_profile(self.device)
        if self.v0:
            device = device.with_overheads(frontend_token_us=V0_FRONTEND_TOKEN_US)
        return EngineModel(
            resolve_model(self.model),
            device,
            self.tp,
            kv_cache_dtype=self.kv_cache_dtype,
            serial_output_processing=self.source in SERIAL_OUTPUT_SOURCES,
        )


INF = math.inf
V0_SOURCES = frozenset({"S1", "S6", "N8"})  # vLLM 0.6.0, 0.5.4 and 0.3.3
# Before 0.6.0 (0.5.4, 0.3.3): outputs processed after each step, in the engine's process.
SERIAL_OUTPUT_SOURCES = frozenset({"S6", "N8"})
V0_FRONTEND_TOKEN_US = 150.0  # fitted with the rest (sim_calibration.py --fit); V1: Overheads'
# vLLM 0.6.0 had chunked prefill off by default (below 32k context): prefills ran alone, and
# its (V0) default max_num_seqs was 256 on every GPU.
_S1 = ServerSettings(
    gpu_memory_utilization=0.9, enable_chunked_prefill=False, max_model_len=4096, max_num_seqs=256
)
# vLLM 0.5.4 likewise turned chunked prefill on by itself only past 32k of context.
_S6 = ServerSettings(
    gpu_memory_utilization=0.95, enable_chunked_prefill=False, max_num_seqs=256, max_model_len=2000
)
_N1 = ServerSettings(enable_prefix_caching=False)  # --no-enable-prefix-caching
# N1's DGX H200 server, its KV cache as row 104's per-request timeline shows it (the source's
# saved results keep every request's TTFT and ITLs): prefill stops with 19 prompts of 30,000
# tokens resident and no preemption (every gap under 0.85 s), and waits 31 decode steps, until
# the first of them ends, for the 511 blocks of the next one's first chunk. So the cache held
# at least the 35,712 blocks of 16 tokens those 19 needed at the stall's end, and under the
# 36,187 that would have admitted the next chunk at its start: between 571,000 and 579,000
# tokens (the simulator estimates 691,364 from memory). Its middle; one server for rows 101-105.
_N1_DGX = ServerSettings(enable_prefix_caching=False, num_gpu_blocks=35_950)
# S2's Qwen3-32B server (plain `vllm serve Qwen/Qwen3-32B`, row 14), its KV cache as the same
# page's baseline run of 100 prompts of 32,000 tokens (at most 100 out) bounds it: every one
# was served, so the cache held 32,100 tokens; and its TPOT stayed at 43.4 ms to the p99 (44.3),
# so no second prompt's first chunk (8,192 tokens) ever ran beside a decode, which a cache of
# 40,292 tokens or more would have admitted. Between them (the simulator estimates 28,767 from
# memory, too few to serve that run); its middle, in blocks of 16. (vLLM 0.11 starts only with
# room for one max_model_len sequence, 40,960 tokens by default for this model: so that server
# ran with a shorter max_model_len than the page's plain command shows. A caveat, not a figure.)
_S2_QWEN3_32B = ServerSettings(num_gpu_blocks=2_262)
_N6 = ServerSettings(
    max_model_len=65536, max_num_seqs=1024, max_num_batched_tokens=32768, block_size=1
)
# vLLM 0.3.3 (V0): no chunked prefill, 256 sequences, --gpu-memory-utilization 0.95.
_N8 = ServerSettings(gpu_memory_utilization=0.95, enable_chunked_prefill=False, max_num_seqs=256)
_DSR1 = "deepseek-ai/DeepSeek-R1"
_L8 = "meta-llama/Llama-3.1-8B-Instruct"
_QWEN235 = "Qwen/Qwen3-235B-A22B-Instruct-2507"
# Rows 121-122: the file infers the load (inf*), the GPU count (1*) and the figure's unit (total
# tokens/s*) from a page that prints a bare "Throughput". Row 122's printed mean TTFT (3.4 s for
# 1000 prompts, 217,393 tokens, all sent at once) would need 2 x 6.95e9 x 217,393 FLOPs done in
# about twice that: some 440 TFLOP/s, above the A100's 312 peak; so the inferred load is not
# the run's, and its sibling row shares the inferences.
_N4_QUANT_PAGE = "load, GPU count and unit inferred by the file; row 122's TTFT beats A100's peak"
_MLPERF = (294.0, 293.4)  # OpenOrca in MLPerf's llama2-70b set: mean input*; output (row 125)
# AMD's MLPerf harness batches requests itself (--enable-batcher) and paces the server to
# MLPerf's TPOT bound: its "time per output token" is that harness's, not vLLM's decode step.
_MLPERF_TPOT = "MLPerf harness's own batcher sets its time per output token"
ROWS: tuple[Row, ...] = (
    Row(1, "S1", "A100-80GB", _L8, 1, "sharegpt", 1200, 4,
        median_tpot_ms=14.14, settings=_S1),
    Row(2, "S1", "A100-80GB", _L8, 1, "sharegpt", 2400, 8,
        median_tpot_ms=17.09, settings=_S1),
    Row(3, "S1", "A100-80GB", _L8, 1, "sharegpt", 5000, INF,
        output_throughput=4132.37, settings=_S1),
    Row(4, "S1", "H100-SXM", "meta-llama/Llama-3.1-70B-Instruct", 4, "sharegpt", 1200, 4,
        median_tpot_ms=23.58, settings=_S1),
    Row(5, "S1", "H100-SXM", "meta-llama/Llama-3.1-70B-Instruct", 4, "sharegpt", 2400, 8,
        median_tpot_ms=29.15, settings=_S1),
    Row(6, "S1", "H100-SXM", "meta-llama/Llama-3.1-70B-Instruct", 4, "sharegpt", 5000, INF,
        output_throughput=3700.64, settings=_S1),
    Row(7, "S2", "H100-SXM", "Qwen/Qwen3-8B", 1, "sharegpt", 100, max_concurrency=1,
        output_throughput=132.86, median_tpot_ms=7.22),
    Row(8, "S2", "H100-SXM", "Qwen/Qwen3-8B", 1, "sharegpt", 100, max_concurrency=2,
        output_throughput=257.19, median_tpot_ms=7.30),
    Row(9, "S2", "H100-SXM", "Qwen/Qwen3-8B", 1, "sharegpt", 100, max_concurrency=4,
        output_throughput=496.88, median_tpot_ms=7.40),
    Row(10, "S2", "H100-SXM", "Qwen/Qwen3-8B", 1, "sharegpt", 100, max_concurrency=8,
        output_throughput=917.28, median_tpot_ms=7.67),
    Row(11, "S2", "H100-SXM", "Qwen/Qwen3-14B", 1, "sharegpt", 1000,
        output_throughput=3173.92, median_tpot_ms=117.46),
    Row(12, "S2", "H100-SXM", "Qwen/Qwen3-14B", 1, "random 2000/100", 500,
        output_throughput=505.51, median_tpot_ms=231.62),
    Row(13, "S2", "H100-SXM", "Qwen/Qwen3-14B", 1, "random 4000/200", 500,
        output_throughput=438.56, median_tpot_ms=139.68),
    Row(14, "S2", "H100-SXM", "Qwen/Qwen3-32B", 1, "sharegpt", 1000,
        output_throughput=1131.55, median_tpot_ms=70.72, settings=_S2_QWEN3_32B),
    Row(15, "S2", "A100-80GB", "Qwen/Qwen3-14B", 1, "sharegpt", 1000,
        output_throughput=1887.31, median_tpot_ms=106.15),
    Row(16, "S2", "A100-80GB", "Qwen/Qwen3-14B-FP8", 1, "sharegpt", 1000,
        output_throughput=1604.75, median_tpot_ms=132.69),
    Row(17, "S2", "H200", "deepseek-ai/DeepSeek-R1-0528", 8, "sharegpt", 1000,
        output_throughput=2621.05, median_tpot_ms=177.90),
    Row(18, "S2", "H200", "deepseek-ai/DeepSeek-R1-0528", 8, "random 4000/200", 500,
        output_throughput=753.67, median_tpot_ms=177.37),
    Row(25, "S6", "H100-SXM", "neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8", 1, "sharegpt", 320,
        output_throughput=3400.4, median_itl_ms=19.75, settings=_S6),
    Row(26, "S6", "A100-80GB", "neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8", 1, "sharegpt", 320,
        output_throughput=1517.54, median_itl_ms=42.85, settings=_S6),
    Row(27, "S6", "H100-SXM", "neuralmagic/Meta-Llama-3.1-70B-Instruct-FP8", 4, "sharegpt", 320,
        output_throughput=2242.99, median_itl_ms=38.26, settings=_S6),
    Row(28, "S6", "A100-80GB", "neuralmagic/Meta-Llama-3.1-70B-Instruct-FP8", 4, "sharegpt",
        320, output_throughput=956.53, median_itl_ms=88.25, settings=_S6),
    # S8 re-ran N1's harness; its logs sit beside an independent run on Nebius H200 hosts.
    Row(33, "S8", "H200-Nebius", _DSR1, 8, "random 1000/2000", 50, 10,
        output_throughput=1042.17, settings=_N1),
    Row(34, "S8", "H200-Nebius", _DSR1, 8, "random 1000/2000", 200, 10,
        output_throughput=2498.90, settings=_N1),
    Row(35, "S8", "H200-Nebius", _DSR1, 8, "random 10000/500", 50, 10,
        output_throughput=436.08, settings=_N1),
    Row(36, "S8", "H200-Nebius", _DSR1, 8, "random 30000/100", 50, 10,
        output_throughput=37.76, settings=_N1),
    Row(101, "N1", "H200-DGX", _DSR1, 8, "random 1000/2000", 50, 10,
        output_throughput=1145.36, median_tpot_ms=42.08, settings=_N1_DGX),
    Row(102, "N1", "H200-DGX", _DSR1, 8, "random 5000/1000", 50, 10,
        output_throughput=853.46, median_tpot_ms=50.09, settings=_N1_DGX),
    Row(103, "N1", "H200-DGX", _DSR1, 8, "random 10000/500", 50, 10,
        output_throughput=446.90, median_tpot_ms=75.80, settings=_N1_DGX),
    Row(104, "N1", "H200-DGX", _DSR1, 8, "random 30000/100", 50, 10,
        output_throughput=37.31, median_tpot_ms=471.23, settings=_N1_DGX),
    Row(105, "N1", "H200-DGX", _DSR1, 8, "sharegpt", 500, 10, output_throughput=1380.59,
        median_tpot_ms=62.28, settings=_N1_DGX, sharegpt_means=(102975 / 500, 107666 / 500)),
    Row(106, "N1", "H200-Nebius", _DSR1, 8, "random 1000/2000", 50, 10,
        output_throughput=1500.11, median_tpot_ms=31.12, settings=_N1),
    Row(107, "N1", "H200-Nebius", _DSR1, 8, "sharegpt", 500, 10, output_throughput=1512.76,
        median_tpot_ms=49.96, settings=_N1, sharegpt_means=(102975 / 500, 107666 / 500)),
    Row(113, "N3", "H100-SXM", "meta-llama/Llama-3.1-8B", 1, "random 20000/2000 r0.15", 150,
        max_concurrency=8, output_throughput=450.3, median_itl_ms=15.18),
    Row(114, "N3", "H100-SXM", "meta-llama/Llama-3.1-8B", 1, "random 20000/2000 r0.15", 150,
        max_concurrency=8, output_throughput=517.5, median_itl_ms=12.93, kv_cache_dtype="fp8"),
    Row(115, "N4", "A100-80GB", "Qwen/Qwen3-32B", 1, "sharegpt", 1000,
        output_throughput=832.43, median_tpot_ms=123.31,
        settings=ServerSettings(max_model_len=32768), sharegpt_means=(217.393, 201.396)),
    Row(116, "N4", "A100-80GB", "Qwen/Qwen3-32B", 1, "random 4000/200", 500,
        output_throughput=87.48, median_tpot_ms=96.40),
    Row(118, "N4", "H100-SXM", _QWEN235 + "-FP8", 4, "sharegpt", 1000,
        output_throughput=3592.57, median_tpot_ms=121.96, sharegpt_means=(212.992, 197.6)),
    Row(119, "N4", "A100-80GB", _QWEN235, 8, "sharegpt", 1000,
        output_throughput=1798.14, median_tpot_ms=103.68, sharegpt_means=(217.393, 196.004)),
    Row(120, "N4", "H100-SXM", "zai-org/GLM-4.5-Air", 4, "sharegpt", 1000,
        output_throughput=3815.71, median_tpot_ms=105.53, sharegpt_means=(214.465, 199.895)),
    Row(121, "N4", "H100-SXM", "Qwen/Qwen3-8B", 1, "sharegpt", 1000, total_throughput=13305.38,
        low_trust=_N4_QUANT_PAGE),
    Row(122, "N4", "A100-80GB", "Qwen/Qwen3-8B", 1, "sharegpt", 1000,
        total_throughput=10338.25, low_trust=_N4_QUANT_PAGE),
    Row(124, "N6", "MI300X", _DSR1, 8, "random 3200/800", 500, max_concurrency=256,
        output_throughput=1709.39, median_tpot_ms=140.70, settings=_N6),
    Row(125, "N7", "MI300X", "amd/Llama-2-70b-chat-hf-FP8", 1, "sharegpt", 2000, 8.6,
        output_throughput=2520.27, median_tpot_ms=156.94, kv_cache_dtype="fp8",
        sharegpt_means=_MLPERF, tpot_not_comparable=_MLPERF_TPOT),
    Row(126, "N7", "MI300X", "amd/Llama-2-70b-chat-hf-FP8", 1, "sharegpt", 16000, 73.5 / 8,
        output_throughput=21028.23, median_tpot_ms=143.94, kv_cache_dtype="fp8",
        data_parallel=8, sharegpt_means=_MLPERF, tpot_not_comparable=_MLPERF_TPOT),
    Row(127, "N8", "L40", "huggyllama/llama-7b", 8, "sharegpt", 100, 10,
        output_throughput=766.64, median_tpot_ms=44.47, settings=_N8,
        sharegpt_means=(259.0, 226.32),
        low_trust="an L40 of a V0 vLLM (0.3.3); the model's variant is not stated"),
    Row(128, "N9", "A100-40GB", _L8, 1, "random 1024/128", 20, max_concurrency=1,
        output_throughput=75.0, low_trust="a figure from the post's prose (about 75 tok/s)"),
    Row(129, "N9", "A100-40GB", _L8, 1, "random 1024/128", 160, max_concurrency=8,
        output_throughput=495.0, low_trust="inferred from prose: 6.6 x row 128's figure"),
)  # fmt: skip


# Rows where sources (or one source's two hosts) disagree on the same hardware: the same
# command on the same GPU gives figures further apart than any profile of that GPU can span.
# Marked in sim_calibration.py's table and the manual's calibration page; fitted and counted
# as the others.
_R1_1000 = "rows 33/101/106, one command: 1,042 / 1,145 / 1,500 tok/s (S8, N1 DGX, N1 Nebius)"
_R1_SHAREGPT = "rows 105/107, one command: TPOT 62.3 / 50.0 ms (N1 DGX, N1 Nebius)"
DISAGREE: dict[int, str] = {
    33: _R1_1000,
    101: _R1_1000,
    106: _R1_1000,
    105: _R1_SHAREGPT,
    107: _R1_SHAREGPT,
}

# Rows published slower than the GPU's measured kernels allow. S2's runs of Qwen3-14B and -32B
# at an infinite rate on one H100 (rows 11-14) were 21-30 % slower than the profile with the
# old fitted compute share (0.50), and are 36-55 % slower than it with the share an H100 was
# measured to reach in these models' prefill layers (0.65; h100-sxm.toml): something other
# than the GPU's arithmetic bounds them (the host, the harness, settings the source does not
# give), so the H100 profile follows the measurement, not them. Marked; fitted and counted.
_S2_H100_RATE_INF = "slower than an H100's measured prefill layers allow (gpu_measure.py)"
BELOW_MEASURED_KERNELS: dict[int, str] = dict.fromkeys((11, 12, 13, 14), _S2_H100_RATE_INF)


@dataclass(frozen=True)
class RowResult:
    row: Row
    output_throughput: float
    median_tpot_ms: float
    throughput_error: float | None  # relative: simulated / published - 1
    tpot_error: float | None


def reproduce(row: Row, engine: EngineModel | None = None) -> RowResult:
    engine = engine or row.engine()
    outcome: Outcome = simulate(
        engine,
        row.requests(),
        row.settings,
        request_rate=row.request_rate,
        max_concurrency=row.max_concurrency,
        seed=row.number,
    )
    summary = outcome.summary()
    # A data-parallel row: one replica simulated with its share, the throughput of all.
    if row.total_throughput:  # the source gives input plus output tokens per second
        throughput, published = summary["total_token_throughput"], row.total_throughput
    else:
        throughput, published = summary["output_throughput"], row.output_throughput or 0.0
    throughput *= row.data_parallel
    # Where a source gives the median ITL and not TPOT, ITL is compared (rows 25-28, 113-114).
    tpot = summary["median_tpot_ms"] if row.median_itl_ms is None else summary["median_itl_ms"]
    published_tpot = None if row.tpot_not_comparable else row.median_tpot_ms or row.median_itl_ms
    return RowResult(
        row,
        throughput,
        tpot,
        throughput / published - 1 if published else None,
        tpot / published_tpot - 1 if published_tpot else None,
    )


def median_abs(errors: list[float | None]) -> float:
    values = [abs(e) for e in errors if e is not None]
    return statistics.median(values) if values else math.nan


# The fit: the free figures of `hardware.Overheads`, and the host factor of a host whose rows
# are its own, searched by coordinate descent over these grids.
GRID: dict[str, tuple[float, ...]] = {
    # The routed experts' grouped GEMMs against a dense GEMM's FLOPs (their padding to the
    # kernel's block counted apart, in cost.py): skinny per-expert shapes run far below it.
    "moe_efficiency": (0.1, 0.15, 0.2, 0.3, 0.4, 0.7, 1.0),
    # Not below half: Qwen3-30B-A3B's decode at a few sequences would then take several times
    # what vLLM reports. DeepSeek-R1's rows ask for less, but their slowness follows the host
    # (N1's two hosts differ by a third on one command), not the experts' bytes.
    "moe_bandwidth_efficiency": (0.5, 0.75, 1.0),
    "frontend_token_us": (0.0, 15.0, 30.0, 60.0),
    "frontend_token_us_v0": (50.0, 100.0, 150.0, 250.0),
    # Against the device's measured matmul rate (`DeviceProfile.matmul_flops`).
    "compute_efficiency": (0.4, 0.5, 0.65, 0.8),
    "roofline_sharpness": (1.5, 2.0, 3.0, math.inf),
    # At most 40 us: beyond it 1,000 streams of an 8B model on one H100 turn CPU-bound below
    # 80 % of their roofline (tests/test_sim_cost.py); the medians are the same at 40 and 80.
    "seq_us": (0.0, 20.0, 40.0),
    "step_ms": (0.6, 1.0, 1.6, 2.5, 4.0),
    "bandwidth_efficiency": (0.7, 0.8),
    "weight_only_fp8_efficiency": (0.5, 0.8),
    "host:H200-DGX": (1.0, 1.35, 1.7),
}
Params = dict[str, float]
V0_KEY = "frontend_token_us_v0"  # the V0 rows' API server CPU per token
START: Params = {
    "step_ms": 1.6, "seq_us": 20.0, "bandwidth_efficiency": 0.8, "compute_efficiency": 0.65,
    "frontend_token_us": 30.0, "frontend_token_us_v0": 100.0, "moe_efficiency": 0.7,
    "moe_bandwidth_efficiency": 0.5, "weight_only_fp8_efficiency": 0.5, "host:H200-DGX": 1.0,
    "roofline_sharpness": math.inf,
}  # fmt: skip


def engine_with(row: Row, params: Params) -> EngineModel:
    """The row's engine under `params`, but for the figures its device's profile sets itself
    (`own_overheads`: measured on that device), which a fit over every source leaves."""
    engine = row.engine()
    own = set(engine.device.own_overheads)
    overheads = {
        k: v
        for k, v in params.items()
        if not k.startswith("host:") and k != V0_KEY and k not in own
    }
    if row.v0 and V0_KEY in params:
        overheads["frontend_token_us"] = params[V0_KEY]
    device = engine.device.with_overheads(**overheads)
    host = params.get(f"host:{row.device}")
    if host is not None:
        device = replace(device, host_cpu_factor=host)
    return replace(engine, device=device)


def _reproduce_with(row: Row, params: Params) -> RowResult:
    return reproduce(row, engine_with(row, params))


class Evaluations:
    """Every row reproduced under a set of parameters, kept: the folds of the cross-validation
    walk mostly the same points. `pool` (a multiprocessing pool, or None) spreads a set's rows
    over processes: they are independent virtual runs."""

    def __init__(self, rows: tuple[Row, ...] = ROWS, pool: Pool | None = None) -> None:
        self.rows = rows
        self.pool = pool
        self._seen: dict[tuple[tuple[str, float], ...], list[RowResult]] = {}

    def __call__(self, params: Params) -> list[RowResult]:
        key = tuple(sorted(params.items()))
        if key not in self._seen:
            tasks = [(row, params) for row in self.rows]
            self._seen[key] = (
                self.pool.starmap(_reproduce_with, tasks, chunksize=1)
                if self.pool is not None
                else [_reproduce_with(*task) for task in tasks]
            )
        return self._seen[key]

    @property
    def count(self) -> int:
        return len(self._seen)


def score(results: list[RowResult]) -> float:
    """What the fit lowers: the larger of the two median absolute errors, plus a tenth of the
    mean so that the rows far off count too."""
    trusted = [r for r in results if not r.row.low_trust]
    throughput = median_abs([r.throughput_error for r in trusted])
    tpot = median_abs([r.tpot_error for r in trusted])
    errors = [abs(e) for r in trusted for e in (r.throughput_error, r.tpot_error) if e is not None]
    return max(throughput, tpot) + 0.1 * statistics.fmean(errors)


def fit(
    evaluate: Evaluations, sources: set[str], passes: int = 2, start: Params | None = None
) -> Params:
    """Coordinate descent over GRID on the rows of `sources` alone (the JOINT parameters a
    grid of their pairs at a time), from START: a starting point no row chose."""

    def on_sources(params: Params) -> float:
        return score([r for r in evaluate(params) if r.row.source in sources])

    current = dict(start or START)
    best = on_sources(current)
    for _ in range(passes):
        moved = False
        for names in _coordinates():
            for values in itertools.product(*(GRID[name] for name in names)):
                trial = {**current, **dict(zip(names, values, strict=True))}
                got = on_sources(trial)
                if got < best - 1e-4:
                    best, current, moved = got, trial, True
        if not moved:
            break
    return current


# Searched together in each pass: a mixture of experts' compute is both (its dense part and
# its routed experts), so moving one at a time stalls where both must move.
# The compute efficiency and the roofline's sharpness trade off likewise near the ridge.
JOINT: tuple[tuple[str, ...], ...] = (
    ("compute_efficiency", "moe_efficiency"),
    ("compute_efficiency", "roofline_sharpness"),
)


def _coordinates() -> list[tuple[str, ...]]:
    joint = {name for names in JOINT for name in names}
    return [*JOINT, *((name,) for name in GRID if name not in joint)]


def leave_one_source_out(
    evaluate: Evaluations, passes: int = 2
) -> tuple[list[RowResult], dict[str, Params]]:
    """Each source's rows predicted by a fit on all the other sources' rows."""
    sources = sorted({row.source for row in evaluate.rows})
    predicted: list[RowResult] = []
    fitted: dict[str, Params] = {}
    for held_out in sources:
        params = fit(evaluate, set(sources) - {held_out}, passes)
        fitted[held_out] = params
        predicted += [r for r in evaluate(params) if r.row.source == held_out]
    order = {row.number: i for i, row in enumerate(evaluate.rows)}
    predicted.sort(key=lambda r: order[r.row.number])
    return predicted, fitted


# --- one host's rows: the user's case of `profllm calibrate`, on published data -------------

PER_SOURCE_MIN_ROWS = 5


def observation_of(row: Row) -> Observation:
    """A published row as `fit_records` fits it: its throughput (output, or total where that is
    what the source gives) and its median TPOT (ITL where the source gives that instead)."""
    measured: dict[str, float] = {}
    if row.total_throughput:
        measured["total_token_throughput"] = row.total_throughput
    elif row.output_throughput:
        measured["output_throughput"] = row.output_throughput
    if not row.tpot_not_comparable:
        if row.median_itl_ms:
            measured["median_itl_ms"] = row.median_itl_ms
        elif row.median_tpot_ms:
            measured["median_tpot_ms"] = row.median_tpot_ms
    return Observation(
        label=str(row.number),
        configuration=str(row.number),  # each row its own configuration: left out alone
        model=row.model,
        requests=tuple(row.requests()),
        measured=measured,
        tensor_parallel_size=row.tp,
        settings=row.settings,
        request_rate=row.request_rate,
        max_concurrency=row.max_concurrency,
        seed=row.number,
        kv_cache_dtype=row.kv_cache_dtype,
        throughput_scale=row.data_parallel,
        serial_output_processing=row.source in SERIAL_OUTPUT_SOURCES,
    )


def one_host_groups(min_rows: int = PER_SOURCE_MIN_ROWS) -> dict[tuple[str, str], list[Row]]:
    """The trusted rows of each source on one host (device profile), where there are enough."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in ROWS:
        if not row.low_trust:
            groups.setdefault((row.source, row.device), []).append(row)
    return {key: rows for key, rows in groups.items() if len(rows) >= min_rows}


@dataclass(frozen=True)
class HostCheck:
    """One source's host fitted on its own rows: in sample, and each row left out."""

    source: str
    device: str
    fitted: Fit
    in_sample: list[dict[str, float]]
    held_out: list[HeldOut]


def check_host(
    rows: list[Row],
    free: tuple[str, ...],
    tolerance: float = 1e-3,
    max_evaluations: int = 150,
) -> HostCheck:
    """Fit `free` overheads of the rows' shipped profile on all of them, then predict each
    row by a fit on the others (from the fit on all: near, so fine steps alone)."""
    base = rows[0].engine().device
    observations = [observation_of(row) for row in rows]
    fitted = fit_records.fit(
        observations,
        base,
        free=free,
        steps=(0.05,),
        tolerance=tolerance,
        max_evaluations=max_evaluations,
    )
    profile = fitted.profile(base)
    in_sample = [fit_records.errors(o, fit_records.predict(o, profile)) for o in observations]
    held = fit_records.leave_one_out(
        observations,
        base,
        fitted.params,
        free,
        tolerance=tolerance,
        max_evaluations=max_evaluations // 2,
    )
    return HostCheck(rows[0].source, rows[0].device, fitted, in_sample, held)
