"""Timed trace replay, as `vllm bench serve --dataset-name timed_trace` names it.

A trace is JSON lines, one request per line, with a timestamp, an input length, an output
length and optionally `hash_ids` (the field names are settings, as vLLM's
`--timed-trace-label-*`), or a CSV of `timestamp, input_len, output_len`. Timestamps times
`timed_trace_sec_multiplier` are seconds.

Prompts are token ids, sent as such on the completions endpoint (as vLLM does): each hash id
stands for a block of `timed_trace_chunk_hash_size` tokens, the same tokens wherever the id
appears, so requests that share ids share a real prefix of exactly those tokens and a prefix
cache sees what it would see in production. Where vLLM expands only the hash ids (a line
without them gets an empty prompt), the tokens a line's ids do not cover are the request's own,
so every prompt has its line's input length. vLLM seeds a block by Python's `hash()` of a
string, which changes from process to process; a block here is seeded by the workload's seed
and the id, so a replay is the same every time.

Requests go at their recorded times (`self_timed`, on by default), counted from the first
request of the window replayed: `trace_start_s` and `trace_duration_s` cut the window,
`trace_speedup` (or `trace_target_rate`, a mean rate in requests/s) compresses the clock, and
`num_prompts` caps the count, as vLLM's.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import random
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pytest_profllm.limits import (
    MAX_JSON_LINE_BYTES,
    MAX_REPLAY_S,
    MAX_REQUEST_TOKENS,
    InputLimitError,
    load_json,
)
from pytest_profllm.load.prompt import Codec, DatasetError, PromptRequest

if TYPE_CHECKING:
    from pytest_profllm.plan.suite import BenchmarkConfig

CSV_COLUMNS = ("timestamp", "input_len", "output_len")


@dataclass(frozen=True)
class TraceEntry:
    line: int  # where it is in the file (1-based), for messages and request-unique tokens
    timestamp_s: float  # the recorded time in seconds (timestamp x sec_multiplier)
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()
    # The line this one waits for (its parent's line number): sent no earlier than its own
    # time and not before that request's response ended, plus `delay_s`.
    parent: int | None = None
    delay_s: float = 0.0


def read_trace(config: BenchmarkConfig, max_model_len: int | None = None) -> list[TraceEntry]:
    """Every entry of the trace file, checked: DatasetError names the file and the line. A
    request longer (input and output) than `max_model_len`, the server's context where it is
    known, or than limits.MAX_REQUEST_TOKENS is refused before any prompt is made of it."""
    path = Path(str(config.dataset_path))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"{path}: cannot read the trace: {error}") from None
    multiplier = config.timed_trace_sec_multiplier
    if path.suffix.lower() == ".csv":
        entries = _csv_entries(path, text, multiplier)
    else:
        entries = _json_entries(path, text, config)
    if not entries:
        raise DatasetError(f"{path}: the trace has no requests")
    _check_lengths(path, entries, max_model_len)
    return entries


def _check_lengths(path: Path, entries: list[TraceEntry], max_model_len: int | None) -> None:
    # A line's lengths become lists of that many tokens: 10**9 of them took 5.4 GB.
    limit, whose = ((max_model_len, "the server's max_model_len") if max_model_len
                    else (MAX_REQUEST_TOKENS, "the most tokens a request may have"))
    for entry in entries:
        if entry.input_len + entry.output_len > limit:
            raise DatasetError(
                f"{path}:{entry.line}: input length {entry.input_len:,} and output length "
                f"{entry.output_len:,} exceed {whose} ({limit:,})"
            )


def _json_entries(path: Path, text: str, config: BenchmarkConfig) -> list[TraceEntry]:
    labels = {
        "timestamp": config.timed_trace_label_timestamp,
        "input": config.timed_trace_label_input_length,
        "output": config.timed_trace_label_output_length,
    }
    hash_label = config.timed_trace_label_hash_ids
    links = _Links(config)
    entries: list[TraceEntry] = []
    by_line: dict[int | None, TraceEntry] = {}
    last_timed: TraceEntry | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = load_json(line, what=where, max_bytes=MAX_JSON_LINE_BYTES)
        except InputLimitError as error:
            raise DatasetError(str(error)) from None
        except ValueError as error:
            raise DatasetError(f"{where}: not JSON: {error}") from None
        if not isinstance(item, dict):
            raise DatasetError(f"{where}: each line is a JSON object, not {type(item).__name__}")
        parent, delay = links.read(where, number, item)
        # A line that waits for a parent may leave its time out (AIPerf's multi-turn lines
        # do): it goes when its parent's answer has ended, plus its delay.
        required = [labels["input"], labels["output"]]
        if parent is None or labels["timestamp"] in item:
            required.insert(0, labels["timestamp"])
        missing = [label for label in required if label not in item]
        if missing:
            raise DatasetError(
                f"{where}: no field {', '.join(map(repr, missing))} (it has "
                f"{', '.join(map(repr, item)) or 'none'}; the timed_trace_label_* settings "
                "name the fields)"
            )
        hash_ids = item.get(hash_label, [])
        if not isinstance(hash_ids, list) or not all(_is_int(h) for h in hash_ids):
            raise DatasetError(f"{where}: {hash_label!r} must be a list of integers")
        timed = labels["timestamp"] in item
        timestamp = (
            item[labels["timestamp"]] if timed
            else by_line[parent].timestamp_s / config.timed_trace_sec_multiplier
        )
        entry = _entry(
            where,
            number,
            timestamp,
            item[labels["input"]],
            item[labels["output"]],
            tuple(hash_ids),
            config.timed_trace_sec_multiplier,
            last_timed if timed else None,
        )
        entry = dataclasses.replace(entry, parent=parent, delay_s=delay)
        entries.append(entry)
        by_line[number] = entry
        links.add(where, item, entry)
        if timed:
            last_timed = entry
    return entries


_ROOT = -1  # Bailian's parent_chat_id of a request that waits for none


class _Links:
    """Who waits for whom in a trace: a line names its parent by the parent's request id
    (`timed_trace_label_parent_id`, Bailian's `parent_chat_id`), or else follows the line
    before it in its session (`timed_trace_label_session_id`, AIPerf's `session_id`); its
    `timed_trace_label_delay` is the think time after the parent's answer."""

    def __init__(self, config: BenchmarkConfig) -> None:
        self.session_label = config.timed_trace_label_session_id
        self.delay_label = config.timed_trace_label_delay
        self.id_label = config.timed_trace_label_request_id
        self.parent_label = config.timed_trace_label_parent_id
        self.multiplier = config.timed_trace_sec_multiplier
        self.by_id: dict[object, int] = {}  # request id -> its line
        self.last_in_session: dict[object, int] = {}  # session id -> its latest line

    def read(self, where: str, number: int, item: dict[str, Any]) -> tuple[int | None, float]:
        """The line's parent (a line number) and its delay in seconds."""
        session = self._key(where, item, self.session_label)
        named = self._key(where, item, self.parent_label)
        parent: int | None = None
        if named is not None and named != _ROOT:
            if named not in self.by_id:
                raise DatasetError(
                    f"{where}: {self.parent_label} {named!r} is no earlier line's "
                    f"{self.id_label}"
                )
            parent = self.by_id[named]
        elif session is not None:
            parent = self.last_in_session.get(session)
        delay = item.get(self.delay_label, 0)
        if delay is None:
            delay = 0
        if not isinstance(delay, int | float) or isinstance(delay, bool) or not (
            math.isfinite(delay) and delay >= 0
        ):
            raise DatasetError(
                f"{where}: the {self.delay_label} {delay!r} is not a finite time >= 0"
            )
        # A delay on a line that waits for no one (a session's first turn) has nothing to
        # follow: it is not used.
        return parent, float(delay) * self.multiplier if parent is not None else 0.0

    def add(self, where: str, item: dict[str, Any], entry: TraceEntry) -> None:
        request_id = self._key(where, item, self.id_label)
        if request_id is not None:
            if request_id in self.by_id:
                raise DatasetError(
                    f"{where}: {self.id_label} {request_id!r} is line "
                    f"{self.by_id[request_id]}'s too"
                )
            self.by_id[request_id] = entry.line
        session = self._key(where, item, self.session_label)
        if session is not None:
            self.last_in_session[session] = entry.line

    @staticmethod
    def _key(where: str, item: dict[str, Any], label: str) -> str | int | None:
        value = item.get(label)
        if value is None:
            return None
        if isinstance(value, str) or _is_int(value):
            return value  # type: ignore[no-any-return]
        raise DatasetError(f"{where}: {label!r} must be a string or an integer, not {value!r}")


def _csv_entries(path: Path, text: str, multiplier: float) -> list[TraceEntry]:
    entries: list[TraceEntry] = []
    for number, row in enumerate(csv.reader(io.StringIO(text)), 1):
        cells = [cell.strip() for cell in row]
        if not any(cells):
            continue
        where = f"{path}:{number}"
        if number == 1 and tuple(cell.lower() for cell in cells) == CSV_COLUMNS:
            continue  # the header
        if len(cells) != len(CSV_COLUMNS):
            raise DatasetError(
                f"{where}: a trace CSV row is {', '.join(CSV_COLUMNS)}; this one has "
                f"{len(cells)} cells"
            )
        values: list[float] = []
        for name, cell in zip(CSV_COLUMNS, cells, strict=True):
            try:
                values.append(float(cell))
            except ValueError:
                raise DatasetError(f"{where}: {name} {cell!r} is not a number") from None
        timestamp, input_len, output_len = values
        entries.append(
            _entry(
                where,
                number,
                timestamp,
                _whole(input_len),
                _whole(output_len),
                (),
                multiplier,
                entries[-1] if entries else None,
            )
        )
    return entries


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _whole(value: float) -> int | float:
    return int(value) if value.is_integer() else value  # _entry refuses a fraction by name


def _entry(
    where: str,
    number: int,
    timestamp: Any,
    input_len: Any,
    output_len: Any,
    hash_ids: tuple[int, ...],
    multiplier: float,
    previous: TraceEntry | None,
) -> TraceEntry:
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool):
        raise DatasetError(f"{where}: the timestamp {timestamp!r} is not a number")
    seconds = float(timestamp) * multiplier
    if not math.isfinite(seconds) or seconds < 0:
        raise DatasetError(f"{where}: the timestamp {timestamp!r} is not a finite time >= 0")
    for name, value, least in (("input length", input_len, 1), ("output length", output_len, 1)):
        if not _is_int(value) or value < least:
            raise DatasetError(f"{where}: the {name} {value!r} is not a whole number >= {least}")
    if previous is not None and seconds < previous.timestamp_s:
        raise DatasetError(
            f"{where}: timestamps must not go back: {timestamp!r} comes after "
            f"{previous.timestamp_s / multiplier:g} (line {previous.line})"
        )
    return TraceEntry(number, seconds, int(input_len), int(output_len), hash_ids)


def window(entries: Sequence[TraceEntry], config: BenchmarkConfig) -> list[TraceEntry]:
    """The entries replayed: those within the window, at most num_prompts of them."""
    first = entries[0].timestamp_s
    begin = first + config.trace_start_s
    end = math.inf if config.trace_duration_s is None else begin + config.trace_duration_s
    chosen = [entry for entry in entries if begin <= entry.timestamp_s < end]
    return chosen[: config.num_prompts]


def replay_speedup(entries: Sequence[TraceEntry], config: BenchmarkConfig) -> float:
    """How many times faster than recorded the replay goes: `trace_speedup`, or the speed-up
    that makes the window's mean rate `trace_target_rate`."""
    if config.trace_target_rate is None or not entries:
        return config.trace_speedup
    # A line without a time of its own carries its parent's: the span is the latest time.
    span = max(entry.timestamp_s for entry in entries) - entries[0].timestamp_s
    if span <= 0:
        raise DatasetError(
            f"{config.dataset_path}: trace_target_rate needs requests at different "
            "times; every request of the window has the same timestamp"
        )
    # The mean rate of n requests over a span is (n - 1) / span, as arrivals go.
    return config.trace_target_rate * span / max(len(entries) - 1, 1)


def send_offsets(entries: Sequence[TraceEntry], config: BenchmarkConfig) -> list[float]:
    """Seconds from the replay's start to each entry's send time: its recorded time since the
    window's first request, divided by the speed-up (or scaled to the target mean rate)."""
    if not entries:
        return []
    first = entries[0].timestamp_s
    speedup = replay_speedup(entries, config)
    offsets = [(entry.timestamp_s - first) / speedup for entry in entries]
    if max(offsets) > MAX_REPLAY_S:
        late = next(at for at, offset in enumerate(offsets) if offset > MAX_REPLAY_S)
        raise DatasetError(
            f"{config.dataset_path}:{entries[late].line}: sent {offsets[late]:.3g} s after the "
            f"replay's start, past the {MAX_REPLAY_S / 3600:g} h a replay may last (timestamps "
            "x timed_trace_sec_multiplier / trace_speedup are seconds)"
        )
    return offsets


class BlockTokens:
    """The tokens of each hash id's block: seeded by the seed, the id and the block's size (a
    last block cut short is its own block, as in vLLM), drawn from the vocabulary without
    special tokens."""

    def __init__(self, codec: Codec, seed: int) -> None:
        self._vocabulary = sorted(set(range(codec.vocab_size)) - codec.special_ids)
        self._seed = seed
        self._blocks: dict[tuple[int, int], list[int]] = {}

    def block(self, hash_id: int, size: int) -> list[int]:
        key = (hash_id, size)
        if key not in self._blocks:
            rng = random.Random(f"profllm-trace:{self._seed}:{hash_id}:{size}")
            self._blocks[key] = rng.choices(self._vocabulary, k=size)
        return self._blocks[key]

    def own(self, line: int, size: int) -> list[int]:
        """Tokens no other request has: a request's tokens beyond its hash ids."""
        rng = random.Random(f"profllm-trace-request:{self._seed}:{line}")
        return rng.choices(self._vocabulary, k=size)


def prompt_ids(entry: TraceEntry, chunk_size: int, blocks: BlockTokens) -> list[int]:
    """The entry's prompt: its hash ids' blocks up to its input length, then its own tokens."""
    ids: list[int] = []
    remaining = entry.input_len
    for hash_id in entry.hash_ids:
        if remaining <= 0:
            break
        size = min(chunk_size, remaining)
        ids += blocks.block(hash_id, size)
        remaining -= size
    if remaining > 0:
        ids += blocks.own(entry.line, remaining)
    return ids


def trace_prompts(
    config: BenchmarkConfig, codec: Codec, max_model_len: int | None = None
) -> list[PromptRequest]:
    """The replayed requests, token ids as prompts, each with its send time (`timestamp`)."""
    entries = window(read_trace(config, max_model_len), config)
    if not entries:
        raise DatasetError(
            f"{config.dataset_path}: no request of the trace lies in the window "
            f"(trace_start_s {config.trace_start_s:g}, trace_duration_s "
            f"{config.trace_duration_s})"
        )
    blocks = BlockTokens(codec, config.seed)
    offsets = send_offsets(entries, config)
    speedup = replay_speedup(entries, config)
    # A parent outside the window is not replayed: its children wait only for their time.
    place = {entry.line: at for at, entry in enumerate(entries)}
    requests = []
    for entry, offset in zip(entries, offsets, strict=True):
        ids = prompt_ids(entry, config.timed_trace_chunk_hash_size, blocks)
        after = place.get(entry.parent) if entry.parent is not None else None
        requests.append(
            PromptRequest(
                prompt="",
                prompt_len=len(ids),
                output_len=entry.output_len,
                prompt_ids=tuple(ids),
                timestamp=offset,
                after=after,
                after_delay_s=entry.delay_s / speedup if after is not None else 0.0,
            )
        )
    return requests


def implied_prefix_hit_rate(
    entries: Sequence[TraceEntry], chunk_size: int, block_size: int
) -> float:
    """The share of prompt tokens a prefix cache of `block_size`-token blocks, large enough
    to keep everything, finds when the entries come one after another: a block is found when
    an earlier prompt began with the same tokens up to its end (chained block hashes, as
    vLLM's). As vLLM, the last token of a prompt is always computed, so at most its first
    `len - 1` tokens can be found."""
    return ideal_prefix_hit_rate((_token_units(entry, chunk_size) for entry in entries),
                                 block_size)


def ideal_prefix_hit_rate(prompts: Iterable[Sequence[Hashable]], block_size: int) -> float:
    """`implied_prefix_hit_rate` of prompts given as their tokens (or stand-ins equal exactly
    when the tokens are), in the order sent: prompt tokens found over prompt tokens, as
    vLLM's `prefix_cache_hits` over `prefix_cache_queries` count them for new requests."""
    seen: set[int] = set()
    found = total = 0
    for units in prompts:
        length = len(units)
        total += length
        usable = (length - 1) // block_size
        parent, hit = 0, True
        for index in range(length // block_size):
            parent = hash((parent, tuple(units[index * block_size : (index + 1) * block_size])))
            if hit and index < usable and parent in seen:
                found += block_size
            else:
                hit = False
            seen.add(parent)
    return found / total if total else 0.0


def prefix_hit_figures(
    prompts: Sequence[PromptRequest], block_size: object, server_rate: object
) -> dict[str, float | None]:
    """A trace case's ideal prefix-cache hit rate with the server's block size (its prompts
    in the order of the trace) and the server's reported rate over it (the telemetry's
    `server_kv_block_size` and `server_prefix_cache_hit_rate`); nulls where either cannot
    be had."""
    size = block_size if isinstance(block_size, int) and not isinstance(block_size, bool) else 0
    if size < 1 or not prompts or any(p.prompt_ids is None for p in prompts):
        return {"implied_prefix_cache_hit_rate": None, "prefix_cache_hit_rate_vs_implied": None}
    ideal = ideal_prefix_hit_rate((p.prompt_ids or () for p in prompts), size)
    rate = server_rate if isinstance(server_rate, float | int) else None
    ratio = float(rate) / ideal if rate is not None and ideal > 0 else None
    return {"implied_prefix_cache_hit_rate": ideal, "prefix_cache_hit_rate_vs_implied": ratio}


def _token_units(entry: TraceEntry, chunk_size: int) -> list[tuple[object, ...]]:
    """A stand-in per token that is equal exactly when the tokens are: its block's hash id
    and size and its place there, or the request's own."""
    units: list[tuple[object, ...]] = []
    remaining = entry.input_len
    for hash_id in entry.hash_ids:
        if remaining <= 0:
            break
        size = min(chunk_size, remaining)
        units += [("block", hash_id, size, place) for place in range(size)]
        remaining -= size
    units += [("own", entry.line, place) for place in range(remaining)]
    return units


def synthetic_trace(
    count: int,
    mean_rate: float,
    seed: int,
    *,
    chunk_size: int = 16,
    num_prefixes: int = 8,
    follow_up_share: float = 0.3,
) -> list[dict[str, int | list[int]]]:
    """A trace with what production traffic has and uniform random prompts lack, in
    Mooncake's shape (timestamps in ms, `input_length`, `output_length`, `hash_ids`):

    - arrivals that follow a clock: a Poisson process whose rate swings between 0.4x and
      1.6x the mean over a minute, with bursts;
    - shared prefixes: a few system prompts of 1-8 blocks, picked with Zipf-like popularity;
    - sessions that grow: a share of requests repeat an earlier request's blocks and add new
      ones, as a conversation's next turn does.
    """
    rng = np.random.default_rng(seed)
    period_s = 60.0
    times: list[float] = []
    now = 0.0
    peak = mean_rate * 1.6
    while len(times) < count:  # thinning: candidates at the peak rate, kept by the rate then
        now += float(rng.exponential(1.0 / peak))
        rate = mean_rate * (1.0 + 0.6 * math.sin(2 * math.pi * now / period_s))
        if rng.random() * peak < rate:
            burst = int(rng.integers(1, 6)) if rng.random() < 0.03 else 1
            times += [now] * burst
    times = times[:count]
    prefixes = [
        list(range(1_000_000 * (k + 1), 1_000_000 * (k + 1) + int(rng.integers(1, 9))))
        for k in range(num_prefixes)
    ]
    popularity = 1.0 / np.arange(1, num_prefixes + 1)
    popularity /= popularity.sum()
    next_id = 0
    entries: list[dict[str, int | list[int]]] = []
    for index, moment in enumerate(times):
        output_len = int(np.clip(rng.lognormal(math.log(96), 0.6), 8, 512))
        if entries and rng.random() < follow_up_share:
            earlier = entries[int(rng.integers(max(0, index - 50), index))]
            head = list(earlier["hash_ids"])  # type: ignore[arg-type]
        else:
            head = list(prefixes[int(rng.choice(num_prefixes, p=popularity))])
        added = int(np.clip(rng.lognormal(math.log(12), 0.7), 1, 96))
        hash_ids = head + list(range(next_id, next_id + added))
        next_id += added
        # The last block may be cut short, as a real prompt's is.
        input_len = len(hash_ids) * chunk_size - int(rng.integers(0, chunk_size))
        entries.append(
            {
                "timestamp": round(moment * 1000),
                "input_length": input_len,
                "output_length": output_len,
                "hash_ids": hash_ids,
            }
        )
    return entries


def trace_lines(entries: Sequence[dict[str, int | list[int]]]) -> str:
    return "".join(json.dumps(entry, separators=(",", ":")) + "\n" for entry in entries)


# The trace the package ships (the example suite replays it), made by `synthetic_trace`:
# `python -m pytest_profllm.load.trace` writes it again.
EXAMPLE_TRACE = Path(__file__).parent / "data" / "trace_example.jsonl"


def example_trace() -> str:
    return trace_lines(synthetic_trace(600, 5.0, 0))


if __name__ == "__main__":
    EXAMPLE_TRACE.write_text(example_trace())
