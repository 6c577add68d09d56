"""A secret (api_key, hf_token, ..._token, password) never shows where pytest prints: every
class of the package that holds one masks it in its repr, and a case whose load client raises
prints no key to the terminal or JUnit XML, with pytest's `-l` (locals) too."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
from helpers import pytest_argv
from pydantic import BaseModel

import pytest_profllm
from pytest_profllm.engine.secrets import REDACTED, Secret, bearer, is_secret
from pytest_profllm.load.schedule import LoadSettings
from pytest_profllm.plan.suite import validate_suite
from pytest_profllm.run.serve import api_key_of

KEY = "sk-profllm-test-0123456789"


def _package_classes() -> list[type]:
    """Every class defined in the package's modules that import here (Ray's need Ray)."""
    found: list[type] = []
    for module_info in pkgutil.walk_packages(pytest_profllm.__path__, "pytest_profllm."):
        name = module_info.name
        if name.endswith("__main__") or ".in_vllm." in name:
            continue  # programs, not libraries: importing one runs it
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        found += [
            value for value in vars(module).values()
            if inspect.isclass(value) and value.__module__ == name
        ]
    return found


def _holds_a_secret(name: str, annotation: object) -> bool:
    # A secret is text. A flag named so (the registry's `secret: bool`: whether an argument is
    # one) or a number (`first_token`'s time, joules per output token) holds none.
    if isinstance(annotation, type):
        return is_secret(name) and annotation not in (bool, float, int)
    kinds = {part.strip() for part in str(annotation).split("|")} - {"None"}
    return is_secret(name) and not (kinds and kinds <= {"bool", "float", "int"})


def _secret_fields(cls: type) -> list[tuple[str, bool]]:
    """(field, shown in the repr) of each secret-named field of a dataclass or pydantic model."""
    if dataclasses.is_dataclass(cls):
        return [
            (f.name, f.repr) for f in dataclasses.fields(cls) if _holds_a_secret(f.name, f.type)
        ]
    if issubclass(cls, BaseModel):
        return [
            (name, info.repr and "SecretStr" not in str(info.annotation))
            for name, info in cls.model_fields.items()
            if _holds_a_secret(name, info.annotation)
        ]
    return []


def test_every_class_with_a_secret_field_masks_it_in_its_repr() -> None:
    classes = _package_classes()
    assert len(classes) > 100  # the walk found the package
    holding = {cls.__qualname__: _secret_fields(cls) for cls in classes if _secret_fields(cls)}
    # Those found before this test (found by name: a new one is checked without being listed).
    assert {"LoadSettings", "SimState"} <= set(holding)
    shown = {name: fields for name, fields in holding.items() if any(s for _, s in fields)}
    assert not shown, f"secret fields shown in a repr: {shown}"


def test_the_classes_that_carry_a_key_show_none() -> None:
    settings = LoadSettings("http://127.0.0.1:1", "m", api_key=api_key_of({"api_key": KEY}))
    suite = validate_suite({"server": {"model": "m", "api_key": KEY, "hf_token": KEY}}, "x")
    key = api_key_of({"api_key": [KEY, "other"]})
    headers = bearer(key)
    for value in (settings, suite, key, headers, Secret(KEY)):
        assert KEY not in repr(value), value
        assert KEY not in str(value) or isinstance(value, str)  # a Secret is the key as text
    assert repr(key) == repr(REDACTED) and f"Bearer {key}" == f"Bearer {KEY}"
    assert headers["Authorization"] == f"Bearer {KEY}"
    assert bearer(None) == {} and bearer("") == {}


SUITE = f"""
server:
  model: sim-8b
  api_key: {KEY}
benchmark:
  num_prompts: 4
  random_input_len: 16
  random_output_len: 4
"""

# An exception that escapes inside the load client, with the key in its settings and headers.
BREAK_THE_CLIENT = """
import pytest_profllm.load.client as client

def broken(settings, request):
    headers = client.bearer(settings.api_key)
    raise RuntimeError("the client broke")

client.request_payload = broken
"""


@pytest.mark.parametrize("showlocals", [False, True], ids=["plain", "showlocals"])
def test_a_client_failure_prints_no_key(
    pytester: pytest.Pytester, ports: str, showlocals: bool
) -> None:
    pytester.makefile(".yaml", bench_secret=SUITE)
    pytester.makeconftest(BREAK_THE_CLIENT)
    junit = pytester.path / "junit.xml"
    args = [f"--junitxml={junit}", "--tb=long", *(["-l"] if showlocals else [])]
    result = pytester.run(*pytest_argv(ports, *args, cache=False), timeout=120)
    output = result.stdout.str() + result.stderr.str()
    assert "the client broke" in output, output[-3000:]  # the failure was reported
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert KEY not in output
    xml = Path(junit).read_text()
    assert "the client broke" in xml
    assert KEY not in xml
    if showlocals:
        assert "settings" in output and "headers" in output  # the locals were shown, masked
    for record in (pytester.path / "results").glob("*.json"):
        assert KEY not in record.read_text()


def test_the_check_finds_a_class_that_shows_a_key() -> None:
    @dataclasses.dataclass
    class Leaky:
        api_key: str

    class Model(BaseModel):
        hf_token: str

    assert _secret_fields(Leaky) == [("api_key", True)]
    assert _secret_fields(Model) == [("hf_token", True)]
    assert KEY in repr(Leaky(KEY))  # what the fields' check stands against
