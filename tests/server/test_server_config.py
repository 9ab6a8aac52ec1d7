"""The ``server`` config group: validated like every group (one line naming the key path), and the serve
command's own failures end in one error line and exit code 2, not a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from litellm_pipeline.config.build import to_plain
from litellm_pipeline.config.compose import compose
from litellm_pipeline.config.schema import validate_config
from litellm_pipeline.errors import ConfigError


def test_serve_recipe_composes_the_server_defaults():
    app = validate_config(to_plain(compose(["+recipe=serve"])))
    assert app.task == "serve"
    s = app.server
    assert (s.host, s.port, s.served_model_name, s.max_n) == ("127.0.0.1", 8000, None, 8)
    assert s.drain_timeout_s > 0 and s.max_body_bytes >= 1024


@pytest.mark.parametrize("override, message", [
    ("server.port=70000", "server.port: must be <= 65535 (got 70000)"),
    ("server.max_n=0", "server.max_n: must be >= 1 (got 0)"),
    ("server.drain_timeout_s=-1", "server.drain_timeout_s: must be >= 0"),
    ("+server.colour=blue", "server.colour: unknown key"),
    ("server.log_level=loud", "server.log_level: must be one of"),
    ("server.switch_interval_ms=0", "server.switch_interval_ms: must be > 0"),
])
def test_bad_server_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_config(to_plain(compose(["+recipe=serve", override])))


@pytest.mark.parametrize("ms", [1.0, 0.25, None])
def test_the_switch_interval_holds_while_serving_and_is_put_back(monkeypatch, ms):
    """The engine thread gives up the GIL at every kernel call: while serving, the interpreter hands it back
    within ``server.switch_interval_ms`` (None: Python's own), and the caller's setting returns afterwards."""
    from fastapi import FastAPI

    from litellm_pipeline.config.schema import ServerSection
    from litellm_pipeline.server import serve

    seen = []

    def run(self):
        seen.append(sys.getswitchinterval())
        self.started = True

    monkeypatch.setattr(serve.DrainingServer, "run", run)
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    try:
        serve.run_app(FastAPI(), ServerSection(port=0, switch_interval_ms=ms))
        assert sys.getswitchinterval() == pytest.approx(0.004)
    finally:
        sys.setswitchinterval(before)
    assert seen == [pytest.approx(0.004 if ms is None else ms / 1000)]


def run_serve(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "litellm_pipeline", "+recipe=serve", "device.threads=1",
           f"hydra.run.dir={tmp_path}/run", *overrides]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ})


def test_invalid_server_config_exits_2_with_one_line(tmp_path):
    proc = run_serve(tmp_path, "server.max_n=0")
    assert proc.returncode == 2
    assert "server.max_n: must be >= 1 (got 0)" in proc.stderr and "Traceback" not in proc.stderr


def test_port_in_use_exits_2_naming_it(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_serve(tmp_path, f"server.port={port}", "server.log_level=critical")
    assert proc.returncode == 2, proc.stderr
    assert f"could not listen on 127.0.0.1:{port}" in proc.stderr and "Traceback" not in proc.stderr
