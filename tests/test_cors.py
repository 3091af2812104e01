"""Cross-origin access (CORS) of the server's app: browser pages on other origins may call the
API, as vLLM's server allows by default; preflights pass before authentication."""

from __future__ import annotations

import pytest
import typer
from fastapi.testclient import TestClient

from loom.cli import _cors
from loom.engine.async_engine import AsyncEngine
from loom.server.in_process import InProcessEngineClient
from loom.server.limits import Cors
from loom.server.openai_api import build_app

PAGE = "http://page.example"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
BODY = {"prompt": "hello", "max_tokens": 1}


def test_every_origin_by_default_and_preflights_pass_before_the_api_key(make_tiny):
    with TestClient(build_app(InProcessEngineClient(AsyncEngine(make_tiny())), served_model_name="tiny", api_key="k")) as http:
        pre = http.options("/v1/completions", headers=PREFLIGHT)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
        assert "POST" in pre.headers["access-control-allow-methods"]
        denied = http.post("/v1/completions", json=BODY, headers={"Origin": PAGE})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"
        ok = http.post("/v1/completions", json=BODY, headers={"Origin": PAGE, "Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"
        too_big = http.post("/v1/completions", content=b"x" * (3 << 20), headers={"Origin": PAGE, "Authorization": "Bearer k"})
        assert too_big.status_code == 413 and too_big.headers["access-control-allow-origin"] == "*"
        unkeyed = http.post("/v1/completions", content=b"x" * (3 << 20), headers={"Origin": PAGE})
        assert unkeyed.status_code == 401 and unkeyed.headers["access-control-allow-origin"] == "*"   # before any read


def test_listed_origins_only_and_none_at_all(make_tiny):
    engine = make_tiny()
    with TestClient(build_app(InProcessEngineClient(AsyncEngine(engine)), served_model_name="tiny",
                              cors=Cors(("http://other.example",)))) as http:
        assert "access-control-allow-origin" not in http.post("/v1/completions", json=BODY,
                                                               headers={"Origin": PAGE}).headers
        r = http.post("/v1/completions", json=BODY, headers={"Origin": "http://other.example"})
        assert r.headers["access-control-allow-origin"] == "http://other.example"
    with TestClient(build_app(InProcessEngineClient(AsyncEngine(make_tiny())), served_model_name="tiny", cors=None)) as http:
        assert http.options("/v1/completions", headers=PREFLIGHT).status_code == 405
        assert "access-control-allow-origin" not in http.post("/v1/completions", json=BODY,
                                                               headers={"Origin": PAGE}).headers


def test_the_cli_option():
    assert _cors("*", False) == Cors(("*",), False)
    assert _cors(" http://a , http://b,", True) == Cors(("http://a", "http://b"), True)
    assert _cors("", False).origins == ()
    with pytest.raises(typer.BadParameter, match="name the origins"):
        _cors("*", True)
