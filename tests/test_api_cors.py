"""CORS (LOCKSTEP_ALLOWED_ORIGINS): the listed origins' preflights are answered, others are
not, and an empty list sends no CORS headers at all. The api-server's own ASGI app, driven
in-process: a preflight is answered before any route, Redis or the engine is involved (the
live answer to a browser is in tests/test_api_surface.py)."""

from __future__ import annotations

import asyncio

import httpx

from services.api_server.app import create_app
from shared.settings import ApiServerSettings


def _preflight(origins: list[str], origin: str) -> httpx.Response:
    async def go() -> httpx.Response:
        app = create_app(ApiServerSettings(allowed_origins=origins))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as c:
            return await c.options("/v1/chat/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST"})
    return asyncio.run(asyncio.wait_for(go(), 30))


def test_only_the_listed_origins_are_allowed():
    ok = _preflight(["https://ui.example"], "https://ui.example")
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ui.example"
    other = _preflight(["https://ui.example"], "https://elsewhere.example")
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_an_empty_list_turns_cors_off():
    r = _preflight([], "https://ui.example")
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


def test_the_environment_takes_a_comma_list(monkeypatch):
    monkeypatch.setenv("LOCKSTEP_ALLOWED_ORIGINS", "https://a.example, https://b.example")
    assert ApiServerSettings.from_env().allowed_origins == ["https://a.example", "https://b.example"]
    monkeypatch.setenv("LOCKSTEP_ALLOWED_ORIGINS", "")
    assert ApiServerSettings.from_env().allowed_origins == []
    monkeypatch.delenv("LOCKSTEP_ALLOWED_ORIGINS")
    assert ApiServerSettings.from_env().allowed_origins == ["*"]
