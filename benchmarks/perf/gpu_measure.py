"""What the simulator's device profile assumes, measured on a real NVIDIA GPU with torch; and
NVML telemetry and GPU leasing checked on it.

    python benchmarks/perf/gpu_measure.py [--models Qwen/Qwen3-14B,...] [--json FILE]
    python benchmarks/perf/gpu_measure.py --compare FILE [--device H100-SXM]

The first form runs on a GPU host (torch, nvidia-ml-py, filelock and psutil; not the rest of
the project's dependencies). It measures, in a child process:

- the device-to-device copy bandwidth and the bf16 matmul rate of an 8192^3 product;
- for each model (shapes from the simulator's catalog), one decoder layer as vLLM runs it,
  eager: RMSNorm, the fused QKV projection, per-head q/k norms, rotary embedding, causal
  flash attention (grouped-query), output projection, the fused gate/up projection, SiLU-and-
  multiply and the down projection. A prefill step of 8 prompts of 1,024 tokens (8,192
  tokens, vLLM's batch limit on an H100) and of 2 of 1,024, and decode steps of 1 to 256
  sequences with 1,024 tokens of context each, eager and replayed from a CUDA graph (as vLLM
  runs its decode steps; eager, a small batch is bound by kernel launches). Eight layers with
  weights of their own are run in turn, so no layer's weights sit in the 50 MB L2 cache; a
  step's time is the mean layer times the model's layers, plus its LM head for the sampled
  tokens.

while the parent samples the GPU through the project's own NVML code (`hosts/nvml.py`): the
readings, the energy counter against the power readings, the child seen holding memory (what
`--profllm-busy-gpus` relies on) and its memory released after it exits, and the GPU lease
(`hosts/pool.py`) taken, refused to a second taker, and released.

`--compare` runs here and sets the measurements beside what the simulator's profile gives
for the same steps (`EngineModel.kernel_seconds`): the achieved shares of the datasheet
bandwidth and of the profile's matmul rate that the cost model assumes (`bandwidth_efficiency`
and `compute_efficiency`), and the step times.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CATALOG = ROOT / "pytest_profllm" / "sim" / "data" / "models.json"
DEFAULT_MODELS = "Qwen/Qwen3-8B,Qwen/Qwen3-14B,Qwen/Qwen3-32B"
LAYERS_IN_TURN = 8
PREFILL_SHAPES = ((8, 1024), (2, 1024))  # (prompts, tokens each)
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXT = 1024


def shapes(model: str) -> dict[str, int]:
    # The catalog read directly, not through sim/models.py: this runs where the project's
    # dependencies (orjson, pydantic) are not installed.
    config = json.loads(CATALOG.read_text())["models"][model]
    heads = config["num_attention_heads"]
    return {
        "layers": config["num_hidden_layers"],
        "hidden": config["hidden_size"],
        "heads": heads,
        "kv_heads": config["num_key_value_heads"],
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "intermediate": config["intermediate_size"],
        "vocab": config["vocab_size"],
    }


def layer_params(s: dict[str, int]) -> int:
    qkv = s["hidden"] * (s["heads"] + 2 * s["kv_heads"]) * s["head_dim"]
    out = s["heads"] * s["head_dim"] * s["hidden"]
    mlp = 3 * s["hidden"] * s["intermediate"]
    return qkv + out + mlp


# ---- the child: torch on the GPU -------------------------------------------------------


class Timer:
    """Median seconds of a callable over repeats: device events on CUDA, after warm-ups."""

    def __init__(self, torch: Any, cuda: bool) -> None:
        self.torch, self.cuda = torch, cuda

    def __call__(self, fn: Any, *args: Any, reps: int, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn(*args)
        times = []
        for _ in range(reps):
            if self.cuda:
                start = self.torch.cuda.Event(enable_timing=True)
                end = self.torch.cuda.Event(enable_timing=True)
                start.record()
                fn(*args)
                end.record()
                self.torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            else:
                begun = time.perf_counter()
                fn(*args)
                times.append(time.perf_counter() - begun)
        return statistics.median(times)


def measure(models: list[str], device: str, small: bool) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    timed = Timer(torch, cuda)
    result: dict[str, Any] = {"device": device, "torch": torch.__version__}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        result["gpu"] = {"name": props.name, "sms": props.multi_processor_count}

    # Copy bandwidth: bytes read plus bytes written.
    count = (2**30 if not small else 2**22) // 2
    source = torch.randn(count, device=device, dtype=dtype)
    target = torch.empty_like(source)
    copy_s = timed(target.copy_, source, reps=20)
    result["copy_gbs"] = 2 * source.numel() * source.element_size() / copy_s / 1e9
    source = target = None

    # The matmul rate of a large square product, over three pairs of inputs in turn, so that
    # no pair sits in L2 from the product before.
    size = 8192 if not small else 256
    pairs = [
        [torch.randn(size, size, device=device, dtype=dtype) for _ in range(2)] for _ in range(3)
    ]
    turn = itertools.cycle(pairs)
    matmul_s = timed(lambda: torch.mm(*next(turn)), reps=30)
    result["matmul_tflops"] = 2 * size**3 / matmul_s / 1e12
    pairs = []

    result["models"] = {}
    for model in models:
        s = shapes(model)
        if small:
            s |= {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 128}
            s |= {"vocab": 512}
        result["models"][model] = ModelBench(torch, s, device, dtype, timed).run(small)
        if cuda:
            torch.cuda.empty_cache()
    return result


class ModelBench:
    """One model's decoder layers, timed as a prefill step and as decode steps."""

    def __init__(self, torch: Any, s: dict[str, int], device: str, dtype: Any, timed: Timer):
        self.torch, self.s, self.device, self.dtype, self.timed = torch, s, device, dtype, timed
        self.F = torch.nn.functional
        self.q_width = s["heads"] * s["head_dim"]
        self.kv_width = s["kv_heads"] * s["head_dim"]
        hidden, hd = s["hidden"], s["head_dim"]
        self.layers = [
            {
                "qkv": self.weight(self.q_width + 2 * self.kv_width, hidden),
                "o": self.weight(hidden, self.q_width),
                "gate_up": self.weight(2 * s["intermediate"], hidden),
                "down": self.weight(hidden, s["intermediate"]),
                "norm1": torch.ones(hidden, device=device, dtype=dtype),
                "norm2": torch.ones(hidden, device=device, dtype=dtype),
                "q_norm": torch.ones(hd, device=device, dtype=dtype),
                "k_norm": torch.ones(hd, device=device, dtype=dtype),
            }
            for _ in range(LAYERS_IN_TURN)
        ]
        self.lm_head = self.weight(s["vocab"], hidden)

    def weight(self, rows: int, cols: int) -> Any:
        return self.randn(rows, cols) * cols**-0.5

    def randn(self, *shape: int) -> Any:
        return self.torch.randn(*shape, device=self.device, dtype=self.dtype)

    def rope(self, x: Any, cos: Any, sin: Any) -> Any:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def layer(self, w: dict[str, Any], x: Any, rotary: tuple[Any, Any], kv: Any) -> Any:
        """One decoder layer over x (batch, q_len, hidden); kv: the cached context (decode) or
        None (prefill: the prompts attend to themselves, causally)."""
        F, s = self.F, self.s
        batch, q_len, hidden = x.shape
        heads, kv_heads, hd = s["heads"], s["kv_heads"], s["head_dim"]
        h = F.rms_norm(x, (hidden,), w["norm1"])
        q, k, v = F.linear(h, w["qkv"]).split((self.q_width, self.kv_width, self.kv_width), dim=-1)
        q = F.rms_norm(q.view(batch, q_len, heads, hd), (hd,), w["q_norm"]).transpose(1, 2)
        k = F.rms_norm(k.view(batch, q_len, kv_heads, hd), (hd,), w["k_norm"]).transpose(1, 2)
        v = v.view(batch, q_len, kv_heads, hd).transpose(1, 2)
        q, k = self.rope(q, *rotary), self.rope(k, *rotary)
        if kv is None:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            attended = F.scaled_dot_product_attention(q, kv[0], kv[1], enable_gqa=True)
        merged = attended.transpose(1, 2).reshape(batch, q_len, self.q_width)
        x = x + F.linear(merged, w["o"])
        h = F.rms_norm(x, (hidden,), w["norm2"])
        gate, up = F.linear(h, w["gate_up"]).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, w["down"])

    def all_layers(self, x: Any, rotary: tuple[Any, Any], caches: list[Any] | None) -> None:
        for i, w in enumerate(self.layers):
            self.layer(w, x, rotary, None if caches is None else caches[i % len(caches)])

    def all_gemms(self, x: Any, attended: Any, activated: Any) -> None:
        """The four projections alone, with inputs of their widths."""
        for w in self.layers:
            self.F.linear(x, w["qkv"])
            self.F.linear(attended, w["o"])
            self.F.linear(x, w["gate_up"])
            self.F.linear(activated, w["down"])

    def per_layer(
        self, reps: int, x: Any, rotary: tuple[Any, Any], caches: Any
    ) -> tuple[float, float]:
        """Seconds of one whole layer and of its GEMMs alone."""
        layer_s = self.timed(self.all_layers, x, rotary, caches, reps=reps)
        widths = (self.q_width, self.s["intermediate"])
        inputs = [self.randn(*x.shape[:-1], width) for width in widths]
        gemm_s = self.timed(self.all_gemms, x, *inputs, reps=reps)
        return layer_s / LAYERS_IN_TURN, gemm_s / LAYERS_IN_TURN

    def graphed_layer(self, reps: int, x: Any, rotary: tuple[Any, Any], caches: Any) -> Any:
        """Seconds of one layer replayed from a CUDA graph, as vLLM runs its decode steps (eager,
        a small batch's step is bound by kernel launches); None off CUDA, or where the capture
        fails (the error is printed)."""
        torch = self.torch
        if not self.timed.cuda:
            return None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    self.all_layers(x, rotary, caches)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.all_layers(x, rotary, caches)
        except RuntimeError as error:
            print(f"CUDA graph capture failed: {error}", file=sys.stderr)
            return None
        return self.timed(graph.replay, reps=reps) / LAYERS_IN_TURN

    def rotary(self, positions: int) -> tuple[Any, Any]:
        angle = self.torch.rand(positions, self.s["head_dim"] // 2, device=self.device)
        return angle.cos().to(self.dtype), angle.sin().to(self.dtype)

    def run(self, small: bool) -> dict[str, Any]:
        s, F = self.s, self.F
        params = layer_params(s)
        reps = 5 if not small else 2
        out: dict[str, Any] = {"layer_params": params, "layers": s["layers"], "shapes": s}
        out["prefill"] = []
        for prompts, length in PREFILL_SHAPES:
            length = length if not small else 32
            x = self.randn(prompts, length, s["hidden"])
            layer_s, gemm_s = self.per_layer(reps, x, self.rotary(length), None)
            head_s = self.timed(F.linear, self.randn(prompts, s["hidden"]), self.lm_head, reps=reps)
            tokens, attended = prompts * length, prompts * length * (length + 1) / 2
            attention_flops = 4 * s["heads"] * s["head_dim"] * attended
            out["prefill"].append(
                {
                    "prompts": prompts,
                    "length": length,
                    "tokens": tokens,
                    "attended": attended,
                    "layer_ms": layer_s * 1e3,
                    "gemm_ms": gemm_s * 1e3,
                    "gemm_tflops": 2 * params * tokens / gemm_s / 1e12,
                    "layer_tflops": (2 * params * tokens + attention_flops) / layer_s / 1e12,
                    "lm_head_ms": head_s * 1e3,
                    "step_ms": (layer_s * s["layers"] + head_s) * 1e3,
                }
            )
        out["decode"] = []
        for batch in DECODE_BATCHES:
            context = DECODE_CONTEXT if not small else 32
            x = self.randn(batch, 1, s["hidden"])
            cache_shape = (batch, s["kv_heads"], context, s["head_dim"])
            caches = [(self.randn(*cache_shape), self.randn(*cache_shape)) for _ in range(2)]
            layer_s, gemm_s = self.per_layer(reps, x, self.rotary(1), caches)
            graph_s = self.graphed_layer(reps, x, self.rotary(1), caches)
            head_s = self.timed(F.linear, x.view(batch, s["hidden"]), self.lm_head, reps=reps)
            size = x.element_size()
            weight_bytes = params * size
            kv_bytes = 2 * batch * s["kv_heads"] * context * s["head_dim"] * size
            out["decode"].append(
                {
                    "batch": batch,
                    "context": context,
                    "layer_ms": layer_s * 1e3,
                    "graph_layer_ms": None if graph_s is None else graph_s * 1e3,
                    "gemm_ms": gemm_s * 1e3,
                    "gemm_gbs": weight_bytes / gemm_s / 1e9,
                    "layer_gbs": (weight_bytes + kv_bytes) / layer_s / 1e9,
                    "lm_head_ms": head_s * 1e3,
                    "step_ms": (layer_s * s["layers"] + head_s) * 1e3,
                    "graph_step_ms": (
                        None if graph_s is None else (graph_s * s["layers"] + head_s) * 1e3
                    ),
                }
            )
        return out


# ---- the parent: NVML and the lease, with the project's code ---------------------------


def check_nvml_and_lease(child: subprocess.Popen[bytes]) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from pytest_profllm.hosts import nvml
    from pytest_profllm.hosts.devices import real_gpus
    from pytest_profllm.hosts.pool import HostPool, LeaseTimeout

    found: dict[str, Any] = {}
    host = nvml.discover()
    found["gpus"] = [g.__dict__ for g in host.gpus]
    found["driver"] = host.driver_version
    gpus = real_gpus("gpu")
    found["real_gpus"] = gpus
    if not gpus:
        child.wait()
        return found

    # The lease: one taker holds the GPU; a second is refused within its timeout.
    with tempfile.TemporaryDirectory() as pool_dir:
        pool = HostPool(
            Path(pool_dir),
            tuple(i for i, _ in gpus),
            tuple(u for _, u in gpus),
            range(47000, 47400),
        )
        first = pool.acquire(1, timeout=5)
        try:
            pool.acquire(len(gpus), timeout=1)
            found["second_lease"] = "granted (wrong)"
        except LeaseTimeout as refused:
            found["second_lease"] = f"refused: {refused}"
        found["lease"] = {"gpus": first.gpus, "uuids": first.gpu_uuids, "port": first.port}
        first.release()
        again = pool.acquire(1, timeout=5)
        found["lease_after_release"] = again.gpus
        again.release()

    reader = nvml.NvmlGpus.open([gpus[0][0]])
    assert reader is not None
    energy_start = reader.energy()
    readings, holders_seen, busy_error = [], {}, None
    while child.poll() is None:
        now = time.perf_counter()
        for reading in reader.read():
            readings.append({"t": now, **reading.__dict__})
        for index, held in reader.memory_holders().items():
            if child.pid in held:
                holders_seen[index] = max(holders_seen.get(index, 0.0), held[child.pid])
        if busy_error is None and holders_seen:
            try:
                nvml.wait_until_idle([gpus[0][1]], wait=False, timeout=0)
            except nvml.GpuBusy as busy:
                busy_error = str(busy)
        time.sleep(0.5)
    energy_end = reader.energy()
    released_at = time.monotonic()
    problem = nvml.wait_gpu_memory_released(reader, {child.pid}, timeout=30)
    found["memory_released"] = {"problem": problem, "after_s": time.monotonic() - released_at}
    reader.close()
    found["child_pid"] = child.pid
    found["child_seen_holding_mib"] = holders_seen
    found["busy_message"] = busy_error
    found["readings"] = readings
    span = energy_end.at - energy_start.at
    if energy_start.problem or energy_end.problem:
        found["energy"] = {"problem": energy_start.problem or energy_end.problem}
    else:
        joules = (sum(energy_end.millijoules) - sum(energy_start.millijoules)) / 1000
        powers = [r["power_w"] for r in readings if r["power_w"] is not None]
        found["energy"] = {
            "joules": joules,
            "seconds": span,
            "mean_w_from_counter": joules / span,
            "mean_w_from_power_readings": statistics.fmean(powers) if powers else None,
        }
    return found


def summarise(result: dict[str, Any]) -> None:
    print(f"device: {result.get('gpu')}; torch {result['torch']}")
    copy, matmul = result["copy_gbs"], result["matmul_tflops"]
    print(f"copy {copy:.0f} GB/s (read + written); 8192^3 bf16 matmul {matmul:.1f} TFLOP/s")
    for model, m in result["models"].items():
        print(f"{model}: {m['layers']} layers of {m['layer_params'] / 1e6:.0f} M parameters")
        for p in m["prefill"]:
            shape = f"{p['prompts']}x{p['length']}"
            print(
                f"  prefill {shape}: layer {p['layer_ms']:.3f} ms ({p['layer_tflops']:.0f} "
                f"TFLOP/s), GEMMs {p['gemm_ms']:.3f} ms ({p['gemm_tflops']:.0f} TFLOP/s), "
                f"step {p['step_ms']:.1f} ms"
            )
        for d in m["decode"]:
            print(
                f"  decode {d['batch']:>3}: layer {d['layer_ms']:.3f} ms ({d['layer_gbs']:.0f} "
                f"GB/s), GEMMs {d['gemm_ms']:.3f} ms ({d['gemm_gbs']:.0f} GB/s), "
                f"step {d['step_ms']:.2f} ms"
                + (
                    f"; from a CUDA graph: layer {d['graph_layer_ms']:.3f} ms, "
                    f"step {d['graph_step_ms']:.2f} ms"
                    if d.get("graph_step_ms") is not None
                    else ""
                )
            )
    telemetry = result.get("nvml")
    if not telemetry:
        return
    shown = {k: v for k, v in telemetry.items() if k != "readings"}
    print("nvml:", json.dumps(shown, default=str))
    busy = [r for r in telemetry.get("readings", []) if (r["utilization"] or 0) > 50]
    if busy:

        def median(key: str) -> float:
            return statistics.median(r[key] for r in busy)

        print(
            f"  while busy ({len(busy)} readings): utilisation {median('utilization'):.0f} %, "
            f"power {median('power_w'):.0f} W, SM clock {median('sm_clock_mhz'):.0f} MHz, "
            f"temperature {max(r['temperature_c'] for r in busy):.0f} C, "
            f"memory {max(r['memory_used_mib'] for r in busy):.0f} MiB"
        )


# ---- here: the measurements beside the profile -----------------------------------------


def compare(path: Path, device_name: str) -> None:
    sys.path.insert(0, str(ROOT))
    from pytest_profllm.sim.cost import EngineModel, StepWork
    from pytest_profllm.sim.hardware import device_profile
    from pytest_profllm.sim.models import resolve_model

    result = json.loads(path.read_text())
    profile = device_profile(device_name)
    over = profile.overheads
    achievable = profile.matmul_flops(False)
    datasheet = profile.memory_bandwidth_gbs
    print(f"measured on {result.get('gpu', {}).get('name')}, against the {profile.name} profile")
    print(
        f"  matmul 8192^3: {result['matmul_tflops']:.1f} TFLOP/s; the profile's achievable rate "
        f"{achievable / 1e12:.1f}, of which a forward pass reaches compute_efficiency "
        f"{over.compute_efficiency:.2f} = {achievable * over.compute_efficiency / 1e12:.0f}"
    )
    print(
        f"  copy: {result['copy_gbs']:.0f} GB/s read + written = "
        f"{result['copy_gbs'] / datasheet:.2f} of the datasheet's {datasheet:.0f}; "
        f"the profile's kernels read at {over.bandwidth_efficiency:.2f} of it"
    )
    for name, measured in result["models"].items():
        engine = EngineModel(resolve_model(name), profile)
        print(f"{name}:")
        for p in measured["prefill"]:
            work = StepWork(
                prefill_tokens=p["tokens"],
                prefill_attended=p["attended"],
                emitted=p["prompts"],
                prefill_seqs=p["prompts"],
            )
            sim_ms = engine.kernel_seconds(work) * 1e3
            print(
                f"  prefill {p['prompts']}x{p['length']}: measured {p['step_ms']:.1f} ms, "
                f"simulated {sim_ms:.1f} ms ({sim_ms / p['step_ms'] - 1:+.0%}); a layer reaches "
                f"{p['layer_tflops'] * 1e12 / achievable:.2f} of the achievable rate "
                f"(GEMMs alone {p['gemm_tflops'] * 1e12 / achievable:.2f})"
            )
        for d in measured["decode"]:
            work = StepWork(
                decode_seqs=d["batch"], decode_context=d["batch"] * d["context"], emitted=d["batch"]
            )
            sim_ms = engine.kernel_seconds(work) * 1e3
            # Eager, a small batch's step is bound by kernel launches; vLLM replays its decode
            # steps from CUDA graphs, which is the figure to compare where there is one.
            step_ms = d.get("graph_step_ms") or d["step_ms"]
            how = "from a CUDA graph" if d.get("graph_step_ms") else "eager"
            print(
                f"  decode {d['batch']:>3}: measured {step_ms:.2f} ms ({how}), simulated "
                f"{sim_ms:.2f} ms ({sim_ms / step_ms - 1:+.0%}); its GEMMs read the weights "
                f"at {d['gemm_gbs'] / datasheet:.2f} of the datasheet"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--compare", type=Path, help="a --json file: set it beside the profile")
    parser.add_argument("--device", default="H100-SXM", help="the profile --compare reads")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--small", action="store_true", help="tiny shapes, to try the script on a CPU"
    )
    args = parser.parse_args()
    if args.compare:
        compare(args.compare, args.device)
        return
    models = [m for m in args.models.split(",") if m]
    if args.child:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        print(json.dumps(measure(models, device, args.small)))
        return
    command = [sys.executable, __file__, "--child", "--models", args.models] + (
        ["--small"] if args.small else []
    )
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        telemetry = check_nvml_and_lease(child)
    finally:
        if child.poll() is None:
            child.kill()
    stdout = child.stdout.read() if child.stdout else b""
    child.wait()
    if child.returncode != 0:
        sys.exit(f"the measuring process failed (exit {child.returncode})")
    result = json.loads(stdout.decode().strip().splitlines()[-1])
    result["nvml"] = telemetry
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    summarise(result)


if __name__ == "__main__":
    main()
