"""Seconds and peak memory of one scrape of a hostile /metrics (load/scrape.py), each in a
process of its own, against a loopback server in this script:

- `1gib`: a 1 GiB body, its length not declared (read until the limit, limits.MAX_METRICS_BYTES);
- `1gib-declared`: the same with its Content-Length (refused before the body is read);
- `endless`: a body that never ends;
- `trickle`: one line every 0.5 s, never ending (the whole scrape's deadline,
  limits.METRICS_DEADLINE_S, ends it);
- `64-engines`: what vLLM 0.33 could honestly send, the simulated engine's families for 64
  engines (1.9 MB), which must be read whole within the deadline;
- `sampler`: the telemetry sampler (run/telemetry.py) for 3 s of a load against `endless`: a
  scrape every 0.5 s, and one before and after.

    python benchmarks/perf/metrics_scrape.py [CASE ...]

Prints, per case, what the scrape said, its seconds and the process's peak RSS (its
ru_maxrss, the interpreter and imports included). Run on demand (not collected by pytest).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

GIB = 1 << 30
CASES = ("1gib", "1gib-declared", "endless", "trickle", "64-engines", "sampler")
_LINE = b'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5"} 1\n' * 1024


def _engines(count: int) -> bytes:
    from pytest_profllm.sim.batching import ConstantStepCost, Scheduler
    from pytest_profllm.sim.instruments import render_metrics

    one = render_metrics(Scheduler(ConstantStepCost(), max_num_seqs=4,
                                   max_num_batched_tokens=64), "m").decode()
    lines = [line for line in one.splitlines() if line.startswith("#")]
    samples = [line for line in one.splitlines() if not line.startswith("#")]
    for engine in range(count):
        lines += [line.replace('engine="0"', f'engine="{engine}"') for line in samples]
    return ("\n".join(lines) + "\n").encode()


def _stream(handler: BaseHTTPRequestHandler, total: int | None, every_s: float = 0.0,
            declare: bool = False) -> None:
    handler.send_response(200)
    if declare and total is not None:
        handler.send_header("Content-Length", str(total))
    handler.end_headers()
    sent = 0
    chunk = b"profllm:trickle 1\n" if every_s else _LINE
    try:
        while total is None or sent < total:
            handler.wfile.write(chunk)
            sent += len(chunk)
            if every_s:
                handler.wfile.flush()
                time.sleep(every_s)
    except OSError:
        pass  # the scraper hung up


def serve(engines: bytes) -> ThreadingHTTPServer:
    routes: dict[str, Callable[[BaseHTTPRequestHandler], None]] = {
        "/1gib": lambda h: _stream(h, GIB),
        "/1gib-declared": lambda h: _stream(h, GIB, declare=True),
        "/endless": lambda h: _stream(h, None),
        "/sampler": lambda h: _stream(h, None),
        "/trickle": lambda h: _stream(h, None, every_s=0.5),
        "/64-engines": lambda h: _send(h, engines),
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            routes[self.path](self)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _send(handler: BaseHTTPRequestHandler, body: bytes) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def measure(case: str, url: str) -> dict[str, Any]:
    """In this (child) process: one scrape, or the sampler's 3 s."""
    from pytest_profllm.load.scrape import scrape_metrics
    from pytest_profllm.run.telemetry import Sampler

    began = time.monotonic()
    if case == "sampler":
        with Sampler(None, [], url) as sampler:
            time.sleep(3)
        said = str(sampler.record()["telemetry_problem"])
    else:
        scraped = scrape_metrics(url)
        said = scraped.unread or f"{len(scraped)} series"
    return {"case": case, "said": said, "seconds": round(time.monotonic() - began, 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=list(CASES))
    parser.add_argument("--child", nargs=2, metavar=("CASE", "URL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    server = serve(_engines(64))
    port = server.server_address[1]
    try:
        for case in args.cases:
            done = subprocess.run(
                [sys.executable, __file__, "--child", case, f"http://127.0.0.1:{port}/{case}"],
                capture_output=True, text=True, timeout=120, check=True,
            )
            row = json.loads(done.stdout)
            print(f"{row['case']:14} {row['seconds']:6.2f} s {row['peak_rss_mb']:5d} MB  "
                  f"{row['said'][:120]}")
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
