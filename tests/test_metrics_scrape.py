"""A server's /metrics as outside input (load/scrape.py, load/server_view.py, run/telemetry.py):
read within a size and one deadline for the whole scrape, a series that is not finite, negative
or not a histogram left out with its reason, and a record written whatever the server sent.
The servers here are small loopback ones, on 127.0.0.1, stopped whatever a test does."""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_profllm.limits import MAX_METRICS_LINE_CHARS, MAX_METRICS_SERIES
from pytest_profllm.load import scrape
from pytest_profllm.load.scrape import Scraped, parse_metrics, scrape_metrics
from pytest_profllm.load.server_view import HISTOGRAMS, load_view, server_view
from pytest_profllm.results.record_files import record_bytes
from pytest_profllm.run.telemetry import Sampler, metrics_problem, server_metric_deltas

TTFT = "vllm:time_to_first_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"
KV = "vllm:kv_cache_usage_perc"
BOUNDS = (0.01, 0.05, 0.1, 0.5, 1.0)


# --- a loopback server that sends what a test asks -------------------------------------------

Behaviour = Callable[[BaseHTTPRequestHandler], None]


class _Handler(BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, Behaviour]] = {}

    def do_GET(self) -> None:
        behaviour = self.routes.get(self.path)
        if behaviour is None:
            self.send_error(404)
            return
        with contextlib.suppress(OSError):  # the scraper hung up (read enough, or too late)
            behaviour(self)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def served() -> Iterator[Callable[[str, Behaviour], str]]:
    """Serve a behaviour at a path: returns the URL. Stopped whatever the test does."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    routes: dict[str, Behaviour] = {}
    _Handler.routes = routes
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def serve(path: str, behaviour: Behaviour) -> str:
        routes[path] = behaviour
        return f"http://127.0.0.1:{server.server_address[1]}{path}"

    try:
        yield serve
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def body(text: str | bytes) -> Behaviour:
    data = text.encode() if isinstance(text, str) else text

    def send(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    return send


def trickle(every_s: float, lines: int = 200) -> Behaviour:
    """A body of one gauge line every `every_s`, `lines` of them at most (the scraper hangs up
    long before)."""

    def send(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.end_headers()
        for index in range(lines):
            handler.wfile.write(f"profllm:trickle_{index} 1\n".encode())
            handler.wfile.flush()
            time.sleep(every_s)

    return send


def endless(limit_bytes: int = 256 << 20) -> Behaviour:
    """A body that does not end (until the scraper hangs up, or `limit_bytes` went out)."""
    line = b"profllm:endless 1\n" * 4096

    def send(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.end_headers()
        sent = 0
        while sent < limit_bytes:
            handler.wfile.write(line)
            sent += len(line)

    return send


# --- expositions ----------------------------------------------------------------------------


def histogram(name: str, cumulative: list[float], count: float, total: float,
              engines: int = 1) -> str:
    """A histogram in Prometheus text, the same figures for each engine."""
    lines = [f"# TYPE {name} histogram"]
    for engine in range(engines):
        labels = f'engine="{engine}",model_name="m"'
        for bound, value in zip([*BOUNDS, math.inf], cumulative, strict=True):
            le = "+Inf" if math.isinf(bound) else repr(bound)
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {_number(value)}')
        lines.append(f"{name}_count{{{labels}}} {_number(count)}")
        lines.append(f"{name}_sum{{{labels}}} {_number(total)}")
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def gauge(name: str, value: float) -> str:
    return f'# TYPE {name} gauge\n{name}{{engine="0"}} {_number(value)}\n'


def served_n(n: int, each_s: float = 0.06) -> tuple[list[float], float, float]:
    """Cumulative buckets, count and sum of `n` requests of `each_s` seconds."""
    cumulative = [float(n) if each_s <= bound else 0.0 for bound in BOUNDS]
    return [*cumulative, float(n)], float(n), n * each_s


def scrape_of(text: str) -> Scraped:
    return parse_metrics(text)


# --- 1. NaN and infinity --------------------------------------------------------------------


def test_a_nan_gauge_is_left_out_with_its_reason() -> None:
    scraped = scrape_of(gauge(KV, math.nan) + gauge("vllm:num_requests_running", 3))
    assert KV not in scraped
    assert scraped["vllm:num_requests_running"] == 3
    assert scraped.left_out == {KV: f"{KV} is nan, not a count or size"}
    problem = metrics_problem(scraped, scraped)
    assert problem is not None and KV in problem and "nan" in problem


@pytest.mark.parametrize("bad", ["sum", "bucket", "count"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -5.0])
def test_a_histogram_with_one_bad_sample_is_left_out_whole(bad: str, value: float) -> None:
    buckets, count, total = served_n(8)
    before = scrape_of(histogram(TTFT, [0.0] * 6, 0, 0) + histogram(E2E, [0.0] * 6, 0, 0))
    if bad == "sum":
        total = value
    elif bad == "bucket":
        buckets[-1] = value
    else:
        count = value
    after = scrape_of(histogram(TTFT, buckets, count, total, engines=2)
                      + histogram(E2E, *served_n(8, 0.2)))
    assert not any(key.startswith(TTFT) for key in after)  # every engine's, every sample
    assert TTFT in after.left_out
    figures, view = load_view(before, after, {"completed": 8, "mean_ttft_ms": 62.0,
                                              "mean_e2el_ms": 202.0})
    assert {key: figures[key] for key in figures if key.startswith("server_ttft")} == dict.fromkeys(
        ("server_ttft_count", "server_ttft_mean_ms", "server_ttft_median_ms",
         "server_ttft_p90_ms", "server_ttft_p99_ms"))
    assert figures["client_overhead_ttft_ms"] is None
    assert figures["server_e2el_count"] == 8  # the other histogram is kept
    assert "ttft (" in view["problem"] and "not to be believed" in view["problem"]
    json.dumps([figures, view], allow_nan=False)


def test_a_bucket_bound_that_is_no_bound_leaves_its_histogram_out() -> None:
    text = histogram(TTFT, *served_n(2)).replace('le="0.5"', 'le="soon"')
    scraped = scrape_of(text)
    assert TTFT in scraped.left_out and "le='soon'" in scraped.left_out[TTFT]
    assert not any(key.startswith(TTFT) for key in scraped)


def test_a_sum_past_a_float_leaves_its_histogram_out() -> None:
    scraped = scrape_of(histogram(TTFT, *served_n(2)[:2], 1.7e308, engines=2))
    assert "sums past what a float holds" in scraped.left_out[TTFT]
    huge = scrape_of(histogram(TTFT, *served_n(2)[:2], 1e306))
    figures, view = server_view({}, huge)  # a mean in ms past a float
    assert figures["server_ttft_mean_ms"] is None
    assert "pass what a float holds" in view["problem"]


# --- 4. a _sum that goes down ---------------------------------------------------------------


def test_a_sum_that_goes_down_is_a_restart_never_a_negative_mean() -> None:
    """The sum went from 125 s to 0.96 while the count grew: only a server that began again
    counts so. Before, the mean was negative and the case was called host busy."""
    before = scrape_of(histogram(TTFT, *served_n(8, 15.625)))  # 8 x 15.625 s = 125 s
    after = scrape_of(histogram(TTFT, *served_n(16, 0.06)))  # 16 x 0.06 s = 0.96 s
    figures, view = load_view(before, after, {"completed": 8, "mean_ttft_ms": 66.0})
    assert figures["server_ttft_mean_ms"] == pytest.approx(60.0)  # the later scrape alone
    assert figures["server_ttft_count"] == 16
    assert figures["client_overhead_ttft_ms"] is None  # not this load's requests alone
    assert "went back during the load (a restart): ttft" in view["problem"]


# --- 5. buckets that are not cumulative, a negative count --------------------------------


def test_buckets_that_are_not_cumulative_are_no_histogram() -> None:
    """Before, they read as a restart: a median of 2,560,000 ms beside a mean of 61 ms, and
    the server's whole life counted."""
    before = scrape_of(histogram(TTFT, [48, 0, 0, 0, 0, 48], 48, 2.9))
    after = scrape_of(histogram(TTFT, [48, 8, 0, 0, 0, 56], 56, 3.4))  # per bucket, not up to
    figures, view = server_view(before, after)
    assert figures["server_ttft_count"] is None and figures["server_ttft_median_ms"] is None
    assert "ttft (its buckets are not cumulative" in view["problem"]


def test_buckets_that_grow_unlike_a_histogram_over_the_load_are_left_out() -> None:
    before = scrape_of(histogram(TTFT, [0, 4, 4, 4, 4, 4], 4, 0.1))
    after = scrape_of(histogram(TTFT, [4, 5, 5, 5, 5, 5], 5, 0.2))  # 4 moved down a bucket
    figures, view = server_view(before, after)
    assert figures["server_ttft_count"] is None
    assert "did not grow as one histogram's" in view["problem"]


def test_a_negative_count_is_left_out_never_a_negative_figure() -> None:
    before = scrape_of(histogram(E2E, [0.0] * 6, 0, 0))
    after = scrape_of(histogram(E2E, [0.0] * 5 + [-5.0], -5, 1.0))
    figures, view = server_view(before, after)
    assert figures["server_e2el_count"] is None
    assert "e2el (" in view["problem"] and "-5" in view["problem"]


@pytest.mark.parametrize(("text", "why"), [
    (f"{TTFT}_count 3\n", "no _sum"),
    (histogram(TTFT, *served_n(3)).replace("+Inf", "9.0"), "no +Inf bucket"),
    (histogram(TTFT, [3, 3, 3, 3, 3, 4], 3, 0.2), "is not its _count"),
    (histogram(TTFT, [1.5] * 6, 1.5, 0.2), "not a whole count"),
    (histogram(TTFT, served_n(16, 0.06)[0], 16, 0.5), "less than its buckets hold at least"),
])
def test_a_histogram_is_believed_only_as_prometheus_defines_one(text: str, why: str) -> None:
    figures, view = server_view({}, scrape_of(text))
    assert figures["server_ttft_count"] is None
    assert why in view["problem"]


def test_counters_that_go_back_give_no_telemetry_figure_and_say_so() -> None:
    before = scrape_of("vllm:prefix_cache_queries_total 100\nvllm:prefix_cache_hits_total 50\n"
                       "vllm:num_preemptions_total 7\n")
    after = scrape_of("vllm:prefix_cache_queries_total 40\nvllm:prefix_cache_hits_total 60\n"
                      "vllm:num_preemptions_total 9\n")
    figures = server_metric_deltas(before, after)
    assert figures["server_prefix_cache_queries"] is None
    assert figures["server_prefix_cache_hit_rate"] is None
    assert figures["server_num_preemptions"] == 2
    problem = metrics_problem(before, after)
    assert problem is not None and "prefix_cache_queries_total went back" in problem
    more_hits = scrape_of("vllm:prefix_cache_queries_total 110\nvllm:prefix_cache_hits_total 80\n")
    assert server_metric_deltas(before, more_hits)["server_prefix_cache_hits"] is None
    assert "grew by 30, more than the 10 tokens looked up" in str(
        metrics_problem(before, more_hits))


# --- 2, 3. the body's size and the whole scrape's deadline -------------------------------


def test_a_trickling_body_ends_at_the_deadline(served: Callable[[str, Behaviour], str]) -> None:
    url = served("/metrics", trickle(0.1))
    began = time.monotonic()
    scraped = scrape_metrics(url, deadline_s=0.5)
    took = time.monotonic() - began
    assert scraped == {} and scraped.unread == "did not finish within 0.5 s"
    assert took < 3  # 0.5 s, and a loose bound for a busy host; it never ended before


def test_a_trickling_head_ends_at_the_deadline(served: Callable[[str, Behaviour], str]) -> None:
    def head(handler: BaseHTTPRequestHandler) -> None:
        handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
        for index in range(90):  # under http.client's 100 headers
            handler.wfile.write(f"X-Slow-{index}: 1\r\n".encode())
            handler.wfile.flush()
            time.sleep(0.1)

    began = time.monotonic()
    scraped = scrape_metrics(served("/metrics", head), deadline_s=0.5)
    assert scraped.unread == "did not finish within 0.5 s"
    assert time.monotonic() - began < 3


def test_an_endless_body_is_read_no_further_than_the_limit(
    served: Callable[[str, Behaviour], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    read = [0]
    real = http.client.HTTPResponse.read1

    def counted(self: http.client.HTTPResponse, n: int = -1) -> bytes:
        chunk = real(self, n)
        read[0] += len(chunk)
        return chunk

    monkeypatch.setattr(http.client.HTTPResponse, "read1", counted)
    scraped = scrape_metrics(served("/metrics", endless()), deadline_s=10, max_bytes=100_000)
    assert scraped.unread == "sent more than the 100,000 bytes read"
    assert 100_000 < read[0] <= 100_001


def test_a_declared_length_over_the_limit_is_not_read(
    served: Callable[[str, Behaviour], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def huge(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(1 << 30))
        handler.end_headers()
        handler.wfile.write(b"x" * 1000)

    calls: list[int] = []

    def read1(self: http.client.HTTPResponse, n: int = -1) -> bytes:
        calls.append(n)
        return b""

    monkeypatch.setattr(http.client.HTTPResponse, "read1", read1)
    scraped = scrape_metrics(served("/metrics", huge), max_bytes=1 << 20)
    assert scraped.unread == "sent more than the 1,048,576 bytes read"
    assert calls == []


def test_a_chunked_body_a_redirect_and_an_error_status(
    served: Callable[[str, Behaviour], str],
) -> None:
    def chunked(handler: BaseHTTPRequestHandler) -> None:
        handler.protocol_version = "HTTP/1.1"
        handler.send_response(200)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.send_header("Connection", "close")
        handler.end_headers()
        for part in (gauge(KV, 0.25).encode(), b"vllm:num_requests_waiting 2\n"):
            handler.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        handler.wfile.write(b"0\r\n\r\n")

    def moved(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(307)
        handler.send_header("Location", "/metrics/")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    served("/metrics/", chunked)
    scraped = scrape_metrics(served("/metrics", moved), deadline_s=5)
    assert scraped == {KV: 0.25, "vllm:num_requests_waiting": 2.0}
    assert scrape_metrics(served("/nope", lambda h: h.send_error(500))).unread == "answered 500"
    assert "not an http(s) address" in str(scrape_metrics("ftp://127.0.0.1/metrics").unread)


def test_parsing_honours_the_deadline() -> None:
    text = "".join(f"profllm:x_{index % 500} 1\n" for index in range(20_000))  # several batches
    assert parse_metrics(text).unread is None
    late = parse_metrics(text, deadline=time.monotonic(), deadline_s=0.25)
    assert late == {} and late.unread == "did not finish within 0.25 s"


def test_a_line_too_long_or_unreadable_costs_only_its_metric() -> None:
    text = (gauge(KV, 0.5) + "vllm:num_requests_running{" + "a" * MAX_METRICS_LINE_CHARS
            + '="1"} 1\n' + 'vllm:num_requests_waiting{engine="0" 3\n'
            + "vllm:generation_tokens_total 12\n")
    scraped = scrape_of(text)
    assert scraped == {KV: 0.5, "vllm:generation_tokens_total": 12.0}
    assert "a line of more than" in scraped.left_out["vllm:num_requests_running"]
    assert "not Prometheus text" in scraped.left_out["vllm:num_requests_waiting"]


def test_a_quoted_name_never_reads_as_a_bucket() -> None:
    scraped = scrape_of('{"vllm:time_to_first_token_seconds_bucket@x"} 3\n'
                        + histogram(E2E, *served_n(2)))
    assert not any(key.startswith(TTFT) for key in scraped)
    assert "has an '@'" in scraped.left_out[f"{TTFT}_bucket@x"]
    figures, _ = server_view({}, scraped)
    assert figures["server_e2el_count"] == 2


def test_more_series_than_the_limit_is_no_reading() -> None:
    text = "".join(f"profllm:x_{index} 1\n" for index in range(MAX_METRICS_SERIES + 1))
    assert parse_metrics(text).unread == f"has more than {MAX_METRICS_SERIES:,} series"


def test_the_sampler_ends_on_time_and_the_record_says_why(
    served: Callable[[str, Behaviour], str],
) -> None:
    """A trickling /metrics once kept a case running until SIGTERM; a NaN gauge stopped
    pytest when the record was written."""
    url = served("/slow", trickle(0.1))
    began = time.monotonic()
    with Sampler(None, [], url, interval_s=0.05, metrics_deadline_s=0.3) as sampler:
        time.sleep(0.1)
    assert time.monotonic() - began < 5  # two 0.3 s scrapes and a few samples
    problem = sampler.record()["telemetry_problem"]
    assert isinstance(problem, str) and "did not finish within 0.3 s" in problem
    with Sampler(None, [], served("/nan", body(gauge(KV, math.nan))), interval_s=0.05) as nan:
        time.sleep(0.15)
    record = nan.record()
    assert record["mean_kv_cache_usage"] is None
    assert f"{KV} left out" in str(record["telemetry_problem"])
    json.dumps(record, allow_nan=False)


def test_a_record_is_written_whatever_a_figure_came_to(caplog: pytest.LogCaptureFixture) -> None:
    record = {"run_id": "r1", "results": {"a": math.nan, "b": [1.0, -math.inf]}}
    with caplog.at_level("WARNING", logger="profllm.results"):
        written = json.loads(record_bytes(record))
    assert written["results"] == {"a": None, "b": [1.0, None]}
    assert "results.a, results.b[1] not finite, written as null" in caplog.text


def test_profllm_bench_writes_valid_json_against_a_nan_gauge_and_sum(
    sim_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, `profllm bench` wrote `"server_ttft_mean_ms": NaN`, which is no JSON."""
    from pytest_profllm.cli.main import main

    real = scrape._read_body

    def poisoned(*args: Any) -> Any:
        text = real(*args)
        if not isinstance(text, str):
            return text
        lines = [line.rsplit(" ", 1)[0] + " NaN"
                 if line.startswith((f"{TTFT}_sum", KV)) else line
                 for line in text.splitlines()]
        return "\n".join(lines) + "\n"

    monkeypatch.setattr(scrape, "_read_body", poisoned)
    main(["bench", "--base-url", sim_url, "--model", "sim", "--num-prompts", "4",
          "--random-input-len", "8", "--random-output-len", "3", "--save-result",
          "--result-dir", str(tmp_path), "--result-filename", "out.json",
          "--max-schedule-lag", "1000"])
    result = json.loads((tmp_path / "out.json").read_text(),
                        parse_constant=lambda name: pytest.fail(f"{name} in the result"))
    assert result["completed"] == 4
    assert result["server_ttft_mean_ms"] is None
    assert result["server_e2el_count"] == 4  # the histograms that are fine are kept
    assert "ttft (" in result["server_view"]["problem"]


# --- properties -------------------------------------------------------------------------------

_VALUES = st.one_of(
    st.integers(0, 60).map(float),
    st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -5.0, 2.5, 1e306, 1.7e308]),
)


@st.composite
def expositions(draw: st.DrawFn) -> str:
    """vLLM-like text with TTFT and E2E histograms and gauges, often broken: NaN, infinities,
    negative, fractional, non-cumulative or decreasing series, lines missing, engines repeated."""
    parts: list[str] = []
    for name in (TTFT, E2E):
        if draw(st.booleans()):
            if draw(st.booleans()):  # a histogram as vLLM keeps it
                counts = draw(st.lists(st.integers(0, 20), min_size=6, max_size=6))
                cumulative = [float(sum(counts[: index + 1])) for index in range(6)]
                count = cumulative[-1]
                total = count * draw(st.floats(0, 30, allow_nan=False))
            else:
                cumulative = draw(st.lists(_VALUES, min_size=6, max_size=6))
                count, total = draw(_VALUES), draw(_VALUES)
            parts.append(histogram(name, cumulative, count, total,
                                   engines=draw(st.integers(1, 3))))
    for name in (KV, "vllm:num_requests_running", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total"):
        if draw(st.booleans()):
            parts.append(gauge(name, draw(_VALUES)))
    lines = "".join(parts).splitlines(keepends=True)
    if draw(st.booleans()) and lines:  # a line lost
        del lines[draw(st.integers(0, len(lines) - 1))]
    return "".join(lines)


def _check_figures(before: Scraped | None, after: Scraped) -> None:
    """Every figure finite (the server's non-negative too) or null, null with a reason, and
    all of it JSON."""
    figures, view = load_view(before, after, {"completed": 8, "mean_ttft_ms": 50.0,
                                              "mean_e2el_ms": 400.0})
    telemetry = server_metric_deltas(before, after)
    for key, value in {**figures, **telemetry}.items():
        assert value is None or math.isfinite(value), key
        if key.startswith("server_") and value is not None:
            assert value >= 0, key
    for short, name, _ in HISTOGRAMS:
        sent = f"{name}_count" in after or name in after.left_out
        if sent and figures[f"server_{short}_count"] is None:
            assert view["problem"] and short in view["problem"], (short, view)
        statistics = [figures.get(f"server_{short}_{label}_ms") for label in
                      ("median", "p90", "p99")]
        known = [value for value in statistics if value is not None]
        assert known == sorted(known)
    json.dumps([figures, view, telemetry, metrics_problem(before, after)], allow_nan=False)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expositions(), expositions())
def test_any_exposition_gives_finite_figures_or_null_with_a_reason(
    earlier: str, later: str
) -> None:
    before, after = parse_metrics(earlier), parse_metrics(later)
    _check_figures(before, after)
    _check_figures(None, after)


@pytest.fixture(scope="module")
def bytes_server() -> Iterator[tuple[str, list[bytes]]]:
    """A loopback server that sends the last body put in the list (hypothesis's examples)."""
    bodies: list[bytes] = [b""]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body(bodies[-1])(self)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", bodies
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


_TEXTISH = st.lists(st.sampled_from(
    [b"vllm:time_to_first_token_seconds", b"_bucket", b"_count", b"_sum", b"{", b"}", b"=",
     b'"', b",", b"le", b"+Inf", b"NaN", b"-", b" ", b"\n", b"#", b" TYPE ", b"histogram",
     b"1", b"0.5", b"\\", b"\r", b"\x00", b"\xff", b"e999", b"@", b"__name__", b"_info",
     b".", b"\t"]), max_size=200).map(b"".join)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=4096), _TEXTISH))
def test_any_bytes_are_read_within_the_deadline_and_a_memory_bound(
    bytes_server: tuple[str, list[bytes]], data: bytes
) -> None:
    url, bodies = bytes_server
    bodies.append(data)
    tracemalloc.start()
    try:
        began = time.monotonic()
        scraped = scrape_metrics(url, deadline_s=2.0, max_bytes=2048)
        took = time.monotonic() - began
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert took < 2.0 + 3  # the deadline, and a loose bound for a busy host
    assert peak < 4 << 20  # a 2 KiB limit read: a few MB at most, the parser's own included
    if len(data) > 2048:
        assert scraped.unread == "sent more than the 2,048 bytes read"
    else:
        assert scraped.unread is None
    assert all(math.isfinite(value) and value >= 0 for value in scraped.values())
    _check_figures(scraped, scraped)
