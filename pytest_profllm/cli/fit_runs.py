"""The simulated engine's profile fitted to one host's real vLLM runs (`profllm calibrate DB`,
calibrate.py, is the command over it).

The runs are the valid vLLM rows of `benchmark_runs` (narrowed by `--where`); they must share
a device, a vLLM version and a model. Each becomes a `fit_records.Observation` (its workload
and server settings read from the row's `bench_*` and `server_*` columns); the fit and the
leave-one-configuration-out errors are `sim/fit_records.py`'s.
"""

from __future__ import annotations

import json
import math
import sqlite3
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeGuard

from pytest_profllm.hosts.files import read_only_uri, write_atomic
from pytest_profllm.limits import (
    MAX_CALIBRATE_REQUESTS,
    MAX_CALIBRATE_TOKENS,
    MAX_REQUEST_TOKENS,
)
from pytest_profllm.results.record import read_requests
from pytest_profllm.sim.batching import BLOCK_SIZE
from pytest_profllm.sim.calibration import random_lengths, sharegpt_like
from pytest_profllm.sim.fit_records import (
    METRICS,
    Fit,
    HeldOut,
    Observation,
    errors,
    fit,
    leave_one_out,
    predict,
    problems,
)
from pytest_profllm.sim.hardware import DeviceProfile, UnknownDevice, device_profile
from pytest_profllm.sim.profile_file import FittedOn, profile_toml
from pytest_profllm.sim.virtual import Request, ServerSettings

_SHORT = {
    "output_throughput": "tok/s",
    "median_ttft_ms": "TTFT ms",
    "median_tpot_ms": "TPOT ms",
    "median_itl_ms": "ITL ms",
}


class CalibrationError(ValueError):
    """Why the runs cannot be calibrated on: one line (`code` 1: the runs, 2: the usage)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Host:
    device: str  # the GPU's name, as NVML gave it
    vllm_version: str
    model: str


def read_runs(db: Path, where: str | None, option: str = "--where") -> list[dict[str, Any]]:
    """The valid real-vLLM rows of `benchmark_runs`, narrowed by the SQL condition `where`
    (given as `option`: an error in it is named so)."""
    if not db.is_file():
        raise CalibrationError(f"{db}: no such database", 2)
    sql = "SELECT * FROM benchmark_runs WHERE engine = 'vllm' AND validity = 'valid'"
    if where:
        sql += f" AND ({where})"
    # Read-only: the condition is the user's own SQL over their own file.
    connection = sqlite3.connect(read_only_uri(db), uri=True)
    connection.row_factory = sqlite3.Row
    try:
        return [dict(row) for row in connection.execute(sql + " ORDER BY timestamp, run_id")]
    except sqlite3.Error as error:
        what = option if where else str(db)
        raise CalibrationError(f"{what}: {error}", 2) from None
    finally:
        connection.close()


def host_of(row: dict[str, Any]) -> Host:
    names = _json_list(row.get("system_gpu_names"))
    version = row.get("system_vllm_version") or row.get("engine_version") or "?"
    # vLLM's CPU build: the row's device is "cpu: <the CPU's model name>".
    device = names[0] if names else str(row.get("device") or "?")
    return Host(device, str(version), str(row.get("server_model")))


def _base_name(host: Host) -> str:
    """The shipped profile a host's runs are fitted from: its GPU's, or the CPU base."""
    return "CPU" if host.device == "cpu" or host.device.startswith("cpu: ") else host.device


def one_host(rows: list[dict[str, Any]]) -> Host:
    """The host every row shares; CalibrationError naming them where they are several."""
    if not rows:
        raise CalibrationError(
            "no valid vLLM run to calibrate on (only engine vllm rows whose validity is "
            "valid count; check --where)"
        )
    hosts = sorted({host_of(row) for row in rows}, key=str)
    if len(hosts) > 1:
        listed = "; ".join(f"{h.device}, vLLM {h.vllm_version}, {h.model}" for h in hosts)
        raise CalibrationError(
            f"runs of {len(hosts)} hosts ({listed}): calibrate on one device, vLLM version "
            "and model, e.g. --where \"server_model = '...' AND system_vllm_version = '...'\""
        )
    return hosts[0]


def base_profile(host: Host, name: str | None) -> DeviceProfile:
    try:
        return device_profile(name or _base_name(host))
    except UnknownDevice:
        wanted = f"--base {name}" if name else f"the GPU {host.device!r}"
        raise CalibrationError(
            f"no shipped device profile answers to {wanted}: give --base NAME, the closest "
            "of H100-SXM, H100-PCIe, H200, A100-80GB, A100-40GB, L40S, L40, MI300X (or CPU, "
            "for vLLM's CPU build)",
            2,
        ) from None


def usable(
    rows: list[dict[str, Any]], folder: Path | None
) -> tuple[list[tuple[dict[str, Any], Observation]], list[tuple[str, str]]]:
    """Each row as an observation, or left out with the reason (a row ingest accepted may
    still be no serving run to replay, or hold figures no replay can use)."""
    kept: list[tuple[dict[str, Any], Observation]] = []
    left: list[tuple[str, str]] = []
    for row in rows:
        run_id = str(row.get("run_id"))
        reason = _not_replayable(row)
        if reason is None:
            try:
                made = observation(row, folder)
            except (TypeError, ValueError, OverflowError, ArithmeticError, KeyError) as error:
                reason = f"a column is not a figure to replay: {str(error).splitlines()[:1]}"
            else:
                reason = _over_limits(made)
                if reason is None:
                    kept.append((row, made))
                    continue
        left.append((run_id, reason))
    return kept, left


def _not_replayable(row: dict[str, Any]) -> str | None:
    """Why a row is no serving run the engine model can replay, checked before any of it is
    built (a count of 200,000,000 prompts would be drawn first)."""
    kind = row.get("bench_kind") or "serve"
    if kind != "serve":
        return f"a {kind} run, not a serving run: its figures are not one load's"
    count = row.get("bench_num_prompts") or row.get("completed") or 1
    if not _number(count) or not 1 <= count <= MAX_CALIBRATE_REQUESTS:
        return (f"{count!r} requests: calibrate replays 1 to {MAX_CALIBRATE_REQUESTS:,} "
                "(limits.MAX_CALIBRATE_REQUESTS)")
    if not _number(row.get("bench_seed") or 0):
        return f"seed {row.get('bench_seed')!r} is not a whole number"
    if row.get("bench_dataset_name") == "random":
        for name in ("bench_random_input_len", "bench_random_output_len"):
            value = row.get(name)
            if not _number(value) or not 1 <= value <= MAX_REQUEST_TOKENS:
                return f"{name} {value!r} is not a count of tokens"
        ratio = row.get("bench_random_range_ratio") or 0.0
        if not _number(ratio) or not 0 <= ratio < 1:
            return f"bench_random_range_ratio {ratio!r} is not in [0, 1)"
    for name in ("bench_request_rate", "bench_burstiness", *METRICS):
        value = row.get(name)
        if isinstance(value, float) and math.isnan(value):
            return f"{name} is NaN"
        if name in METRICS and isinstance(value, float) and math.isinf(value):
            return f"{name} is infinite"
    return None


def _over_limits(made: Observation) -> str | None:
    tokens = sum(r.prompt_len + r.output_len for r in made.requests)
    if len(made.requests) > MAX_CALIBRATE_REQUESTS or tokens > MAX_CALIBRATE_TOKENS:
        return (f"{len(made.requests):,} requests of {tokens:,} tokens: calibrate replays "
                f"at most {MAX_CALIBRATE_REQUESTS:,} of {MAX_CALIBRATE_TOKENS:,} "
                "(limits.py)")
    return None


def _number(value: Any) -> TypeGuard[int | float]:
    """A finite number (a whole one where it is an int or a count stored as a float)."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def observation(row: dict[str, Any], folder: Path | None = None) -> Observation:
    """A row as the virtual clock replays it: its prompts' lengths and send times from its
    requests file where one is beside the database in `folder` (the requests that succeeded,
    as the client sent them); else vLLM's random dataset as its flags say, any other as
    log-normal lengths with the run's own mean lengths, on vLLM's schedule for its rate. Its
    load and its server's settings from its columns."""
    count = int(row.get("bench_num_prompts") or row.get("completed") or 1)
    seed = int(row.get("bench_seed") or 0)
    sent = _requests_sent(folder, str(row["run_id"]), _expected(row)) if folder else None
    arrivals: tuple[float, ...] | None = None
    if sent:
        requests = [Request(prompt_len, output_len) for prompt_len, output_len, _ in sent]
        arrivals = tuple(at for _, _, at in sent)
    elif row.get("bench_dataset_name") == "random":
        requests = random_lengths(
            count,
            int(row["bench_random_input_len"]),
            int(row["bench_random_output_len"]),
            float(row.get("bench_random_range_ratio") or 0.0),
            seed,
        )
    else:
        done = max(int(row.get("completed") or count), 1)
        requests = sharegpt_like(
            count,
            seed,
            float(row.get("total_input_tokens") or 0) / done or 217.0,
            float(row.get("total_output_tokens") or 0) / done or 202.0,
        )
    measured = {name: float(row[name]) for name in METRICS if _number(row.get(name))}
    return Observation(
        label=str(row["run_id"]),
        configuration=f"{row.get('configuration')}::{row.get('workload')}",
        model=str(row["server_model"]),
        requests=tuple(requests),
        measured={name: value for name, value in measured.items() if value > 0},
        tensor_parallel_size=_int(row.get("server_tensor_parallel_size")) or 1,
        settings=ServerSettings(
            max_num_seqs=_int(row.get("server_max_num_seqs")),
            max_num_batched_tokens=_int(row.get("server_max_num_batched_tokens")),
            gpu_memory_utilization=float(row.get("server_gpu_memory_utilization") or 0.9),
            # The KV cache the server measured it had, where the row says (a run that fills
            # it is bounded by it, and the simulator's memory estimate is only an estimate);
            # else as its flags set it.
            block_size=_int(row.get("system_server_kv_block_size"))
            or _int(row.get("server_block_size")) or BLOCK_SIZE,
            num_gpu_blocks=_int(row.get("system_server_num_gpu_blocks"))
            or _int(row.get("server_num_gpu_blocks_override")),
            enable_prefix_caching=row.get("server_enable_prefix_caching") not in (0, False),
            enable_chunked_prefill=row.get("server_enable_chunked_prefill") not in (0, False),
            max_model_len=_int(row.get("server_max_model_len")),
        ),
        request_rate=_rate(row.get("bench_request_rate")),
        max_concurrency=_int(row.get("bench_max_concurrency")),
        burstiness=float(row.get("bench_burstiness") or 1.0),
        seed=seed,
        kv_cache_dtype=str(row.get("server_kv_cache_dtype") or "auto"),
        api_server_count=_int(row.get("server_api_server_count")) or 1,
        arrivals=arrivals,
    )


def _requests_sent(
    folder: Path, run_id: str, expected: int | None = None
) -> list[tuple[int, int, float]] | None:
    """(prompt length, output tokens, intended send time from the first) of each request of
    the run's requests file that succeeded, in send order; None where there is no readable
    file, no such request, or a figure that is not one (the run is replayed from its flags)."""
    try:
        # The same reader as ingest: a line at a time, no more rows than the run's own.
        rows = read_requests(folder, run_id, expected)
    except ValueError:
        return None
    sent = []
    for item in rows or ():
        if not item.get("success"):
            continue
        prompt_len, output_len = item.get("prompt_len"), item.get("output_tokens")
        at = item.get("intended_start_s", item.get("start_s"))
        if not (_count(prompt_len) and _count(output_len) and isinstance(at, int | float)
                and not isinstance(at, bool) and math.isfinite(at)
                and prompt_len + output_len <= MAX_REQUEST_TOKENS):
            return None
        sent.append((int(prompt_len), int(output_len), float(at)))
    if not sent:
        return None
    first = min(at for _, _, at in sent)
    return sorted(((p, o, at - first) for p, o, at in sent), key=lambda item: item[2])


def _expected(row: dict[str, Any]) -> int | None:
    """The run's requests (completed + failed), where its row says."""
    counts = [row.get("completed"), row.get("failed")]
    if all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        return sum(counts)  # type: ignore[arg-type]
    return None


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class Calibration:
    host: Host
    base: DeviceProfile
    fitted: Fit
    held_out: list[HeldOut]
    run_ids: list[str]  # the runs the profile was fitted on
    # Where held_out are the runs --hold-out picked, predicted by the fit on the others (not
    # each configuration by a fit on the rest).
    hold_out: str | None = None
    # (run id, why) of each row read that was not replayed: every row is fitted on or named.
    left_out: list[tuple[str, str]] = field(default_factory=list)

    @property
    def profile(self) -> DeviceProfile:
        return self.fitted.profile(self.base)


def calibrate(
    db: Path,
    where: str | None = None,
    base: str | None = None,
    progress: Callable[[str], None] | None = None,
    hold_out: str | None = None,
) -> Calibration:
    """Fit the profile to the runs and predict each configuration by a fit on the others;
    with `hold_out` (an SQL condition), fit on the runs it does not pick and predict those it
    does. Raises CalibrationError where the runs cannot be fitted, saying which runs would
    help."""
    rows = read_runs(db, where)
    host = one_host(rows)
    profile = base_profile(host, base)
    held_ids: set[str] = set()
    if hold_out:
        narrowed = f"({where}) AND ({hold_out})" if where else hold_out
        held_ids = {str(row["run_id"]) for row in read_runs(db, narrowed, "--hold-out")}
        if not held_ids:
            raise CalibrationError(f"--hold-out {hold_out!r} picks none of the runs", 2)
    replayable, left_out = usable(rows, db.parent)
    observations = [made for row, made in replayable if str(row["run_id"]) not in held_ids]
    found = problems(observations)
    if found:
        what = f"{len(observations)} runs" + (" outside --hold-out" if hold_out else "")
        raise CalibrationError(f"cannot fit {what}: " + "; ".join(found))
    fitted = fit(observations, profile)
    if hold_out:
        predicted_profile = fitted.profile(profile)
        held = []
        for row, run in replayable:
            if str(row["run_id"]) in held_ids:
                figures = predict(run, predicted_profile)
                held.append(HeldOut(run, figures, errors(run, figures), fitted.params))
    else:
        # Each fold starts where the whole fit ended: it is near, and the folds run faster.
        held = leave_one_out(observations, profile, fitted.params, progress=progress)
    return Calibration(
        host, profile, fitted, held, [o.label for o in observations], hold_out, left_out
    )


def report_lines(calibration: Calibration) -> list[str]:
    """Every run's measured figures, the leave-one-configuration-out prediction and its
    error; the median and largest errors; the fitted figures."""
    how = (
        f"the {len(calibration.held_out)} runs of --hold-out {calibration.hold_out!r} "
        f"predicted by a fit on the other {len(calibration.run_ids)}"
        if calibration.hold_out
        else f"{len(calibration.run_ids)} runs; each configuration predicted by a fit on the "
        "others"
    )
    lines = [
        f"{calibration.host.model} on {calibration.host.device}, vLLM "
        f"{calibration.host.vllm_version}: {how} (measured -> predicted, error):"
    ]
    lines += [f"  left out {run_id!r}: {why}" for run_id, why in calibration.left_out]
    for item in calibration.held_out:
        o = item.observation
        figures = "  ".join(
            f"{_SHORT[name]} {o.measured[name]:.4g} -> {item.predicted[name]:.4g} "
            f"{item.errors[name] * 100:+.1f}%"
            for name in METRICS
            if name in item.errors
        )
        lines.append(f"  {o.label}  {o.load}, in {o.mean_input:.0f}: {figures}")
    for name in METRICS:
        values = [abs(item.errors[name]) for item in calibration.held_out if name in item.errors]
        if values:
            lines.append(
                f"{_SHORT[name]}: median error {statistics.median(values) * 100:.1f} %, "
                f"largest {max(values) * 100:.1f} % ({len(values)} runs)"
            )
    fitted = calibration.fitted
    shown = ", ".join(
        f"{name} {value:.4g}" + ("" if name in fitted.pinned else " (not pinned: kept)")
        for name, value in fitted.params.items()
    )
    lines.append(f"fitted on all {len(calibration.run_ids)} runs: {shown}")
    return lines


def write_profile(calibration: Calibration, path: Path) -> None:
    fitted_on = FittedOn(
        run_ids=calibration.run_ids,
        device=calibration.host.device,
        vllm_version=calibration.host.vllm_version,
        model=calibration.host.model,
        date=datetime.now(UTC).date().isoformat(),
    )
    profile = calibration.profile
    named = DeviceProfile(
        **{**profile.__dict__, "name": f"{calibration.base.name}-calibrated", "aliases": ()}
    )
    comments = [
        f"Fitted by profllm calibrate on {len(calibration.run_ids)} runs, from "
        f"{calibration.base.name}'s shipped profile (sim/device_profiles).",
        "Use it with --profllm-sim-profile PATH (or profllm sim --sim-profile PATH).",
    ]
    comments += report_lines(calibration)
    write_atomic(path, profile_toml(named, fitted_on, comments).encode())


def _json_list(value: Any) -> list[str]:
    if isinstance(value, list):
        return [str(item) for item in value]
    if isinstance(value, str) and value.startswith("["):
        try:
            loaded = json.loads(value)
        except ValueError:
            return []
        return [str(item) for item in loaded] if isinstance(loaded, list) else []
    return []


def _int(value: Any) -> int | None:
    """A count from a column (a batch limit, a block count, a size): a positive number, else
    none, so that a bad one falls back to the flags' or the estimate's, never prices a run."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value) if math.isfinite(value) and value >= 1 else None


def _rate(value: Any) -> float:
    try:
        rate = float(value)
    except (TypeError, ValueError):
        return math.inf
    return rate if rate > 0 else math.inf
