"""Which clients the admin answers: loopback by default, an allow-list, trusted proxies."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.requests import Request

from torpor import Runtime
from torpor.serve import AdminClients, Server, app, bearer_token, bind
from torpor.serve.access import check_admin
from torpor.serve.problems import Forbidden

ADMIN = "admin-token"


def request(peer: str, *forwarded: str) -> Request:
    headers = [(b"authorization", f"Bearer {ADMIN}".encode())]
    headers += [(b"x-forwarded-for", hop.encode()) for hop in forwarded]
    return Request({"type": "http", "client": (peer, 5000), "headers": headers})


def allowed(clients: AdminClients, peer: str, *forwarded: str) -> bool:
    try:
        check_admin(request(peer, *forwarded), ADMIN, clients=clients)
    except Forbidden:
        return False
    return True


def test_by_default_loopback_clients_only_and_forwarded_headers_ignored() -> None:
    clients = AdminClients()
    assert allowed(clients, "127.0.0.1") and allowed(clients, "::1")
    assert not allowed(clients, "10.1.2.3")
    # nobody is trusted: a proxy on loopback lets its clients through (what the README warns)
    assert allowed(clients, "127.0.0.1", "203.0.113.9")
    assert not allowed(clients, "10.1.2.3", "127.0.0.1")  # a forged header changes nothing


def test_a_trusted_proxy_s_forwarded_for_names_the_client() -> None:
    clients = AdminClients(trusted_proxies=["127.0.0.1", "10.0.0.0/24"])
    assert not allowed(clients, "127.0.0.1", "203.0.113.9")
    assert allowed(clients, "127.0.0.1")  # the proxy's own request (a local tool)
    # the client put 127.0.0.1 in front itself: the last untrusted hop is the client
    assert not allowed(clients, "127.0.0.1", "127.0.0.1, 203.0.113.9")
    assert not allowed(clients, "127.0.0.1", "127.0.0.1", "203.0.113.9, 10.0.0.5")
    assert allowed(clients, "127.0.0.1", "::1, 10.0.0.5")  # every hop trusted: the first
    assert not allowed(clients, "127.0.0.1", "not-an-address")
    assert not allowed(clients, "10.9.9.9", "127.0.0.1")  # not a trusted proxy: ignored


def test_an_allow_list_replaces_loopback() -> None:
    clients = AdminClients(allow=["192.0.2.0/24", "2001:db8::1"],
                           trusted_proxies=["127.0.0.1"])
    assert allowed(clients, "192.0.2.44") and allowed(clients, "2001:db8::1")
    assert not allowed(clients, "198.51.100.1")
    assert not allowed(clients, "::1")  # loopback is not in the list
    assert allowed(clients, "127.0.0.1", "192.0.2.7")
    assert not allowed(clients, "127.0.0.1", "198.51.100.1")
    with pytest.raises(ValueError, match="admin_allow"):
        AdminClients(allow=["10.0.0.0/33"])
    with pytest.raises(ValueError, match="trusted_proxies"):
        AdminClients(trusted_proxies="127.0.0.1")  # type: ignore[arg-type]


@asynccontextmanager
async def served(**options: object) -> AsyncIterator[httpx.AsyncClient]:
    async with Runtime("sqlite://") as rt:
        application = app(rt, authorize=bearer_token("t"), admin_token=ADMIN,
                           **options)  # type: ignore[arg-type]
        sock = bind("127.0.0.1", 0)
        # a server that does not read X-Forwarded-For itself: the app's option decides
        server = Server(uvicorn.Config(application, lifespan="on", log_config=None,
                                       access_log=False, proxy_headers=False))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{sock.getsockname()[1]}",
                headers={"Authorization": f"Bearer {ADMIN}"},
            ) as client:
                yield client
        finally:
            server.should_exit = True
            await task


async def test_over_http_a_trusted_proxy_keeps_its_clients_out() -> None:
    outside = {"X-Forwarded-For": "203.0.113.9"}
    async with served() as client:  # the hole: every client of a local proxy is loopback
        assert (await client.get("/admin/stats", headers=outside)).status_code == 200
    async with served(trusted_proxies=["127.0.0.1"]) as client:
        refused = await client.get("/metrics", headers=outside)
        assert refused.status_code == 403 and refused.json()["error"] == "Forbidden"
        assert (await client.get("/admin/stats")).status_code == 200
    async with served(trusted_proxies=["127.0.0.1"], admin_allow=["203.0.113.0/24"]) as client:
        assert (await client.get("/admin/stats", headers=outside)).status_code == 200
        assert (await client.get("/admin/stats")).status_code == 403


def test_serve_takes_the_flags(tmp_path: Path) -> None:
    env = {**os.environ, "TORPOR_TOKEN": "", "TORPOR_ADMIN_TOKEN": ""}
    result = subprocess.run(
        [sys.executable, "-m", "torpor", "serve", "--db", f"sqlite:///{tmp_path / 'x.db'}",
         "--port", "0", "--admin-allow", "10.0.0.0/33"],
        capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2 and "--admin-allow: '10.0.0.0/33' does not" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "torpor", "serve", "--db", f"sqlite:///{tmp_path / 'x.db'}",
         "--port", "0", "--trusted-proxy", "localhost"],
        capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2 and "--trusted-proxy: 'localhost' does not" in result.stderr
