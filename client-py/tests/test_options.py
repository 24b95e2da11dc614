"""The Python consumer's arguments against the one table of consumer options
(`batchcast::options::CONSUMER_OPTIONS`, exported by the native module):
`batchcast.Consumer`'s signature and docstring, the native `Consumer`'s
signature and its `.pyi` stub, the environment defaults (read by the native
client alone), and a refused value of each option, refused naming it."""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

import batchcast
from batchcast import _native
from batchcast.errors import InvalidArgument

from conftest import synthetic

ROWS: List[Dict[str, Any]] = list(_native.CONSUMER_OPTIONS)
STUB = Path(batchcast.__file__).with_name("_native.pyi")


def rows(surface: str) -> List[Dict[str, Any]]:
    return [r for r in ROWS if r[surface]]


def test_the_wrappers_signature_is_the_tables_python_rows() -> None:
    params = list(inspect.signature(batchcast.Consumer.__init__).parameters.values())[1:]
    got = [(p.name, p.annotation, repr(p.default)) for p in params]
    want = [(r["name"], r["py_type"], r["py_default"]) for r in rows("python")]
    assert got == want


def test_the_native_signature_and_its_stub_are_the_tables_native_rows() -> None:
    want = [(r["name"], r["native_default"]) for r in rows("native")]
    text = _native.Consumer.__text_signature__
    assert text is not None
    native = [
        tuple(part.strip().split("=", 1))
        for part in text.strip("()").split(",")
        if part.strip() and part.strip() not in ("self", "$self", "/", "*")
    ]
    assert native == want, text
    tree = ast.parse(STUB.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Consumer")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args.args[1:]
    defaults = [ast.unparse(d) for d in init.args.defaults]
    stub = [(a.arg, ast.unparse(a.annotation), d) for a, d in zip(args, defaults)]
    assert len(args) == len(defaults)
    assert stub == [(r["name"], r["native_type"], r["native_default"]) for r in rows("native")]


def test_the_docstring_explains_every_argument_and_names_its_variable() -> None:
    doc = batchcast.Consumer.__doc__ or ""
    for r in rows("python"):
        assert re.search(rf"^\s+(\w+, )*{r['name']}(, \w+)*:", doc, re.M), r["name"]
        if r["env"]:
            assert r["env"] in doc, f"{r['name']}: {r['env']} not in the docstring"


@pytest.mark.parametrize("row", [r for r in ROWS if r["python"] and r["refused"]], ids=lambda r: r["name"])
def test_a_refused_value_is_refused_naming_the_option(row: Dict[str, Any], tmp_path: Path) -> None:
    value = ast.literal_eval(row["refused"])
    with pytest.raises(InvalidArgument, match=row["name"]):
        batchcast.Consumer(**{"socket": str(tmp_path / "none.sock"), "output": "numpy", row["name"]: value})


@pytest.mark.parametrize(
    "var, value",
    [
        ("BATCHCAST_CONNECT_TIMEOUT", "soon"),
        ("BATCHCAST_RECONNECT_TIMEOUT", "1m"),
        ("BATCHCAST_JOIN", "later"),
        ("BATCHCAST_DEVICE", "tpu:0"),
        ("BATCHCAST_BATCH_SIZE", "0"),
    ],
)
def test_a_variable_its_option_refuses_is_named(var: str, value: str, tmp_path: Path) -> None:
    code = (
        "import batchcast, sys\n"
        "try:\n"
        f"    batchcast.Consumer(socket={str(tmp_path / 'none.sock')!r}, output='numpy')\n"
        "except batchcast.errors.InvalidArgument as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, var: value},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 3, r.stdout + r.stderr
    assert var in r.stdout and value in r.stdout, r.stdout


def test_the_environment_defaults_reach_the_python_consumer(start_broker) -> None:
    """Set by a launcher, not by the program: the stream, the join and the
    batch size come from the environment alone (the stream's was ignored
    before: the Python default `"train"` was always passed)."""
    socket = start_broker(synthetic("other", batch=8, length=32, epochs=2, slots=8)).socket
    code = (
        "import batchcast, json\n"
        f"c = batchcast.Consumer(socket={str(socket)!r}, output='numpy')\n"
        "n = sum(1 for _ in c)\n"
        "print(json.dumps([c.stream, c.batch_size, n]))\n"
    )
    env = {
        **os.environ,
        "BATCHCAST_STREAM": "other",
        "BATCHCAST_BATCH_SIZE": "4",
        "BATCHCAST_JOIN": "immediate",
    }
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == '["other", 4, 8]'
