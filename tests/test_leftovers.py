"""What a session killed outright leaves: SIGKILL to the controller runs none of
its clean-up, so its turn folder in the pool and the processes its servers started outside
their group stay behind. The next session ends and removes them, and says so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from pytest_profllm.hosts.processes import OWNER_ENV

SUITE = """
server:
  model: Qwen/Qwen3-0.6B
  seed: [1, 2]
benchmark:
  num_prompts: 400
  random_input_len: 16
  random_output_len: 64
  request_rate: 20
"""


def _owned_by(token: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(OWNER_ENV) == token:
                found.append(process)
        except (OSError, psutil.Error):
            continue
    return found


def test_the_next_session_ends_what_a_killed_one_left(
    pytester: pytest.Pytester, port_range: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    pytester.makefile(".yaml", bench_long=SUITE)
    # A pool of its own: its turn folders and orphaned processes are swept by the next
    # session of this pool alone (the test suite's other sessions use another pool).
    pool = tmp_path_factory.mktemp("pool")
    env = {**os.environ, "PROFLLM_POOL_DIR": str(pool),
           "PROFLLM_SIM_FAULTS": "orphan_child"}
    env.pop(OWNER_ENV, None)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2",
            f"--profllm-ports={port_range}", "--profllm-max-schedule-lag=1000"]
    controller = subprocess.Popen(
        argv, cwd=pytester.path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    token = ""
    left: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not left:
            time.sleep(0.5)
            if not token:
                try:
                    token = f"{controller.pid}:{psutil.Process(controller.pid).create_time():.2f}"
                except psutil.Error:
                    break
            # Both servers up, each with its orphan: the session is mid-way.
            orphans = [p for p in _owned_by(token) if "orphan_child" in " ".join(p.cmdline())]
            left = orphans if len(orphans) >= 2 else []
        assert left, "the run never got its servers up"
        turns = [d for d in (pool / "turns").glob("*")
                 if (d / "owner").is_file() and (d / "owner").read_text() == token]
        assert turns, "the session's turn folder"
        controller.send_signal(signal.SIGKILL)
        controller.wait(10)
        time.sleep(3)  # the workers and servers go with their parents; the orphans do not
        assert any(p.is_running() for p in left), "an orphan outlived the killed session"
        # The next session (only collecting) ends them and removes the folder.
        after = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only",
             f"--profllm-ports={port_range}"], cwd=pytester.path, env=env, capture_output=True,
            text=True, timeout=120, check=False,
        )
        assert "left by a session that was killed" in after.stdout, after.stdout[-2000:]
        assert f"removed {turns[0]}, left by a session that was killed" in after.stdout
        time.sleep(0.5)
        assert not [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not [d for d in turns if d.exists()]
    finally:
        if controller.poll() is None:
            controller.kill()
        for process in _owned_by(token) if token else []:
            process.kill()
