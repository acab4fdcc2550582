"""pytest helpers around the shared server launcher (``sgl_jax.testing.ServerProcess``).

``server_fixture`` writes a server's whole log to the terminal when a test of its module failed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import requests

from sgl_jax.testing import ServerProcess

# Servers of the tests run on the CPU, whatever the environment says.
CPU_ENV = {"JAX_PLATFORMS": "cpu"}


def start_server(args: list[str], api_key: str | None = None,
                 env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(args, api_key=api_key, env={**CPU_ENV, **(env or {})})


def server_fixture(request: pytest.FixtureRequest, args: list[str],
                   api_key: str | None = None,
                   env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """Body of a module-scoped fixture: one server for the module, its log shown on failure."""
    failed_before = request.session.testsfailed
    server = start_server(args, api_key=api_key, env=env)
    try:
        yield server
    finally:
        server.stop()
        if request.session.testsfailed > failed_before:
            reporter = request.config.pluginmanager.get_plugin("terminalreporter")
            text = f"\n----- server log ({server.log_path}) -----\n{server.log()}"
            if reporter is not None:
                reporter.write_line(text)
            else:
                print(text)


def sse_events(source: requests.Response | Iterator[str]) -> list[dict | str]:
    """The ``data:`` payloads of an event stream: JSON objects, and "[DONE]" as a string.

    Pass the same ``iter_lines(decode_unicode=True)`` iterator when part of the stream was
    already read: a second ``iter_lines`` would lose what the first one had buffered.
    """
    lines = source.iter_lines(decode_unicode=True) if isinstance(source, requests.Response) \
        else source
    events: list[dict | str] = []
    for line in lines:
        if line and line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
