"""The agentic trace the package ships (`load/data/agentic_trace_example.jsonl`): agents
that share a system prompt and a tool schema, each a session of turns whose context grows,
some spawning subagents that inherit the context so far.

Every line has Mooncake's fields (`timestamp` in ms, `input_length`, `output_length`,
`hash_ids`, one id per `CHUNK` tokens) and those that say who waits for whom:
`session_id` (AIPerf's: a line follows the one before it in its session), `chat_id` and
`parent_chat_id` (Bailian's: a subagent's first turn names the turn that spawned it; -1:
none) and `delay` (the think time after the parent's answer, ms). `python -m
pytest_profllm.load.agentic_trace` writes the file again.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

CHUNK = 32  # tokens per hash id: `timed_trace_chunk_hash_size` of the example suite
SYSTEM = list(range(1, 5))  # the system prompt every agent shares: 4 blocks
TOOLS = list(range(5, 9))  # the tool schema every main agent sends after it: 4 blocks
# The most tokens a prompt may have, so that prompt and answer fit a 1024-token context (the
# tiny model of tests/real_vllm.py).
MAX_PROMPT = 896

EXAMPLE = Path(__file__).parent / "data" / "agentic_trace_example.jsonl"


@dataclass
class _Line:
    timestamp_ms: int
    session: str
    chat_id: int
    parent: int
    delay_ms: int
    hash_ids: list[int]
    output: int

    def json(self) -> dict[str, object]:
        return {
            "timestamp": self.timestamp_ms,
            "session_id": self.session,
            "chat_id": self.chat_id,
            "parent_chat_id": self.parent,
            "delay": self.delay_ms,
            "input_length": len(self.hash_ids) * CHUNK,
            "output_length": self.output,
            "hash_ids": self.hash_ids,
        }


class _Ids:
    def __init__(self) -> None:
        self.block = 100  # ids of blocks no agent shares from the start
        self.chat = 0

    def blocks(self, count: int) -> list[int]:
        self.block += count
        return list(range(self.block - count, self.block))

    def next_chat(self) -> int:
        self.chat += 1
        return self.chat


def agentic_trace(agents: int = 8, seed: int = 0) -> list[dict[str, object]]:
    """`agents` main agents started a second or two apart; each sends turns (its task, then
    each tool result it gets) until its context is full, and two of its turns spawn two
    subagents each, whose own sessions begin with the spawning turn's context."""
    rng = random.Random(seed)
    ids = _Ids()
    lines: list[_Line] = []

    def session(name: str, head: list[int], parent: _Line | None, turns: int,
                start_ms: int, spawns: set[int]) -> None:
        context = head + ids.blocks(rng.randint(1, 2))  # the task or subtask
        before = parent
        at = start_ms
        for turn in range(turns):
            if len(context) * CHUNK > MAX_PROMPT:
                break
            output = rng.randint(8, 32)
            delay = rng.randint(50, 400) if before is not None else 0
            if before is not None:
                # Recorded: the parent's answer took about 20 ms a token, then the think time.
                at = max(at, before.timestamp_ms + 20 * before.output + delay)
            line = _Line(at, name, ids.next_chat(), -1, delay, list(context), output)
            if before is not None and turn == 0:
                line.parent = before.chat_id  # a subagent's first turn waits for its spawner
            lines.append(line)
            if turn in spawns:
                for sub in range(2):
                    session(f"{name}/sub-{turn}-{sub}", list(context), line, rng.randint(2, 3),
                            at + 1, set())
            before = line
            # The answer and the tool's result join the context.
            context = context + ids.blocks(rng.randint(1, 3))

    for agent in range(agents):
        start = agent * rng.randint(1000, 2000)
        spawns = set(rng.sample(range(1, 6), 2))
        session(f"agent-{agent}", SYSTEM + TOOLS, None, 12, start, spawns)
    lines.sort(key=lambda line: (line.timestamp_ms, line.chat_id))
    return [line.json() for line in lines]


def example_text() -> str:
    return "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in agentic_trace())


if __name__ == "__main__":
    EXAMPLE.write_text(example_text())
