"""`profllm schema`: the record's JSON Schema."""

from __future__ import annotations

import argparse
import json

from pytest_profllm.results.record import json_schema


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    schema = commands.add_parser(
        "schema",
        help="print the JSON Schema of the record",
        description="Print the JSON Schema of a benchmark record (schema version 1).",
    )
    schema.set_defaults(handler=_schema)


def _schema(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(), indent=2))
    return 0
