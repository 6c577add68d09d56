"""Published vLLM runs the engine model is fitted on and checked against.

The rows of `shared/data/published-vllm-benchmarks.md` (numbers as their sources state them;
row numbers are that table's), each replayed on the virtual clock (`virtual.py`) with the same
model, device, parallelism, workload and load. ShareGPT prompts are not shipped: a ShareGPT-like
workload draws lengths from log-normal distributions whose means are the published corpus's
(1000 prompts = 217,393 input tokens and about 202 output tokens each for Qwen, row 11),
truncated as vLLM's sample filter does (prompt <= 1024, prompt + output <= 2048 tokens).
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field

from pytest_profllm.sim.cost import EngineModel
from pytest_profllm.sim.hardware import device_profile
from pytest_profllm.sim.models import resolve_model
from pytest_profllm.sim.virtual import Outcome, Request, ServerSettings, simulate

SHAREGPT_MEAN_INPUT = 217.0
SHAREGPT_MEAN_OUTPUT = 202.0


def sharegpt_like(count: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    requests: list[Request] = []
    # sigma: ShareGPT's lengths are heavy-tailed (medians about 60 % of the means).
    s_in, s_out = 1.0, 0.9
    mu_in = math.log(SHAREGPT_MEAN_INPUT) - s_in**2 / 2
    mu_out = math.log(SHAREGPT_MEAN_OUTPUT) - s_out**2 / 2
    while len(requests) < count:
        prompt = max(4, int(rng.lognormvariate(mu_in, s_in)))
        output = max(4, int(rng.lognormvariate(mu_out, s_out)))
        if prompt > 1024 or prompt + output > 2048:
            continue  # vLLM's ShareGPT sampler drops these
        requests.append(Request(prompt, output))
    return requests


def random_fixed(count: int, input_len: int, output_len: int) -> list[Request]:
    return [Request(input_len, output_len) for _ in range(count)]


@dataclass(frozen=True)
class Row:
    number: int  # the row's number in published-vllm-benchmarks.md
    device: str
    model: str
    tp: int
    workload: str  # "sharegpt" or "random IN/OUT"
    num_prompts: int
    request_rate: float = math.inf
    max_concurrency: int | None = None
    # Published figures (None: not given).
    output_throughput: float | None = None
    median_tpot_ms: float | None = None
    median_itl_ms: float | None = None  # compared with TPOT where TPOT is not given
    settings: ServerSettings = field(default_factory=ServerSettings)

    def requests(self) -> list[Request]:
        if self.workload == "sharegpt":
            return sharegpt_like(self.num_prompts, seed=self.number)
        in_len, out_len = (int(part) for part in self.workload.split()[1].split("/"))
        return random_fixed(self.num_prompts, in_len, out_len)

    def engine(self) -> EngineModel:
        return EngineModel(resolve_model(self.model), device_profile(self.device), self.tp)


INF = math.inf
# vLLM 0.6.0 had chunked prefill off by default (below 32k context): prefills ran alone.
# vLLM 0.6.0 had chunked prefill off by default (below 32k context): prefills ran alone, and
# its (V0) default max_num_seqs was 256 on every GPU.
_S1 = ServerSettings(
    gpu_memory_utilization=0.9, enable_chunked_prefill=False, max_model_len=4096, max_num_seqs=256
)
_S6 = ServerSettings(gpu_memory_utilization=0.95, max_num_seqs=256, max_model_len=2000)
ROWS: tuple[Row, ...] = (
    Row(1, "A100-80GB", "meta-llama/Llama-3.1-8B-Instruct", 1, "sharegpt", 1200, 4,
        median_tpot_ms=14.14, settings=_S1),
    Row(2, "A100-80GB", "meta-llama/Llama-3.1-8B-Instruct", 1, "sharegpt", 2400, 8,
        median_tpot_ms=17.09, settings=_S1),
    Row(3, "A100-80GB", "meta-llama/Llama-3.1-8B-Instruct", 1, "sharegpt", 5000, INF,
        output_throughput=4132.37, settings=_S1),
    Row(4, "H100-SXM", "meta-llama/Llama-3.1-70B-Instruct", 4, "sharegpt", 1200, 4,
        median_tpot_ms=23.58, settings=_S1),
    Row(5, "H100-SXM", "meta-llama/Llama-3.1-70B-Instruct", 4, "sharegpt", 2400, 8,
        median_tpot_ms=29.15, settings=_S1),
    Row(6, "H100-SXM", "meta-llama/Llama-3.1-70B-Instruct", 4, "sharegpt", 5000, INF,
        output_throughput=3700.64, settings=_S1),
    Row(7, "H100-SXM", "Qwen/Qwen3-8B", 1, "sharegpt", 100, max_concurrency=1,
        output_throughput=132.86, median_tpot_ms=7.22),
    Row(8, "H100-SXM", "Qwen/Qwen3-8B", 1, "sharegpt", 100, max_concurrency=2,
        output_throughput=257.19, median_tpot_ms=7.30),
    Row(9, "H100-SXM", "Qwen/Qwen3-8B", 1, "sharegpt", 100, max_concurrency=4,
        output_throughput=496.88, median_tpot_ms=7.40),
    Row(10, "H100-SXM", "Qwen/Qwen3-8B", 1, "sharegpt", 100, max_concurrency=8,
        output_throughput=917.28, median_tpot_ms=7.67),
    Row(11, "H100-SXM", "Qwen/Qwen3-14B", 1, "sharegpt", 1000,
        output_throughput=3173.92, median_tpot_ms=117.46),
    Row(12, "H100-SXM", "Qwen/Qwen3-14B", 1, "random 2000/100", 500,
        output_throughput=505.51, median_tpot_ms=231.62),
    Row(13, "H100-SXM", "Qwen/Qwen3-14B", 1, "random 4000/200", 500,
        output_throughput=438.56, median_tpot_ms=139.68),
    Row(14, "H100-SXM", "Qwen/Qwen3-32B", 1, "sharegpt", 1000,
        output_throughput=1131.55, median_tpot_ms=70.72),
    Row(15, "A100-80GB", "Qwen/Qwen3-14B", 1, "sharegpt", 1000,
        output_throughput=1887.31, median_tpot_ms=106.15),
    Row(16, "A100-80GB", "Qwen/Qwen3-14B-FP8", 1, "sharegpt", 1000,
        output_throughput=1604.75, median_tpot_ms=132.69),
    Row(17, "H200", "deepseek-ai/DeepSeek-R1-0528", 8, "sharegpt", 1000,
        output_throughput=2621.05, median_tpot_ms=177.90),
    Row(18, "H200", "deepseek-ai/DeepSeek-R1-0528", 8, "random 4000/200", 500,
        output_throughput=753.67, median_tpot_ms=177.37),
    Row(25, "H100-SXM", "neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8", 1, "sharegpt", 320,
        output_throughput=3400.4, median_itl_ms=19.75, settings=_S6),
    Row(26, "A100-80GB", "neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8", 1, "sharegpt", 320,
        output_throughput=1517.54, median_itl_ms=42.85, settings=_S6),
    Row(27, "H100-SXM", "neuralmagic/Meta-Llama-3.1-70B-Instruct-FP8", 4, "sharegpt", 320,
        output_throughput=2242.99, median_itl_ms=38.26, settings=_S6),
    Row(28, "A100-80GB", "neuralmagic/Meta-Llama-3.1-70B-Instruct-FP8", 4, "sharegpt", 320,
        output_throughput=956.53, median_itl_ms=88.25, settings=_S6),
    Row(33, "H200", "deepseek-ai/DeepSeek-R1", 8, "random 1000/2000", 50, 10,
        output_throughput=1042.17),
    Row(34, "H200", "deepseek-ai/DeepSeek-R1", 8, "random 1000/2000", 200, 10,
        output_throughput=2498.90),
    Row(35, "H200", "deepseek-ai/DeepSeek-R1", 8, "random 10000/500", 50, 10,
        output_throughput=436.08),
    Row(36, "H200", "deepseek-ai/DeepSeek-R1", 8, "random 30000/100", 50, 10,
        output_throughput=37.76),
)  # fmt: skip


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
    throughput = summary["output_throughput"]
    # Where a source gives the median ITL and not TPOT, ITL is compared (rows 25-28).
    tpot = summary["median_tpot_ms"] if row.median_itl_ms is None else summary["median_itl_ms"]
    published_tpot = row.median_tpot_ms or row.median_itl_ms
    return RowResult(
        row,
        throughput,
        tpot,
        throughput / row.output_throughput - 1 if row.output_throughput else None,
        tpot / published_tpot - 1 if published_tpot else None,
    )


def median_abs(errors: list[float | None]) -> float:
    values = [abs(e) for e in errors if e is not None]
    return statistics.median(values) if values else math.nan
