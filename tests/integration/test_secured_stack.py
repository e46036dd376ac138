"""The full stack under roles: `fleet nats --auth` credentials (with and without TLS), then
`fleet up`, whose worker and gateway each connect as their own NATS user. Chat and images go
through HTTP; a raw client under the client role submits a task and reads its output; nothing
any role does is refused by the server."""

from __future__ import annotations

import hashlib
import ssl
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.client import Client

from fleet.bus.auth_gen import generate, read_env
from fleet.bus.replies import inbox_prefix
from fleet.bus.uploads import upload_image
from fleet.wire.ask import AskAnswer
from fleet.wire.codec import ASK_REPLY, decode_with
from fleet.wire.events import TaskFinished
from tests.commands.test_exits import Command, assert_clean, free_port
from tests.integration.harness import hello, run_task, seed_models

CHAT = {"model": "tiny-llm", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
IMAGE = {"model": "tiny-flux2", "prompt": "a fox", "size": "128x128", "steps": 2,
         "response_format": "url"}


async def connect_as(folder: Path, role: str, port: int) -> Client:
    env = read_env(folder / f"{role}.env")
    options: dict[str, object] = {}
    if ca := env.get("FLEET_NATS_TLS_CA"):
        context = ssl.create_default_context(cafile=ca)
        context.load_cert_chain(env["FLEET_NATS_TLS_CERT"], env["FLEET_NATS_TLS_KEY"])
        options["tls"] = context
    scheme = "tls" if options else "nats"
    # With TLS the certificate names the user (verify_and_map): no user or password then.
    return await nats.connect(f"{scheme}://127.0.0.1:{port}", user=env.get("FLEET_NATS_USER"),
                              password=env.get("FLEET_NATS_PASSWORD"), connect_timeout=5,
                              inbox_prefix=inbox_prefix(role), **options)


@pytest.mark.slow
# Both ways of `fleet up` at no extra cost: with `--processes split` its gateway is a process
# of its own, given the gateway role's credentials (fleet/commands/up_gateway.py).
@pytest.mark.parametrize(("tls", "processes"), [(False, "one"), (True, "split")],
                         ids=["passwords-one", "tls-split"])
async def test_fleet_up_serves_chat_and_images_with_each_role_as_itself(
    tmp_path: Path, tiny_llm_dir: Path, tiny_flux2_dir: Path, tls: bool, processes: str
) -> None:
    data = tmp_path / "data"
    seed_models(data, {"tiny-llm": tiny_llm_dir, "tiny-flux2": tiny_flux2_dir})
    nats_port, http_port = free_port(), free_port()
    folder = data / "auth"
    if tls:  # what `fleet nats --auth --tls` does; then `fleet up` finds it by itself
        generate(data, port=nats_port, tls=True)
    up = Command(tmp_path, "up", "--models", "tiny-llm,tiny-flux2", "--port", str(http_port),
                 "--nats-port", str(nats_port), "--processes", processes,
                 *([] if tls else ["--auth"]))
    base = f"http://127.0.0.1:{http_port}"
    try:
        up.wait_for_line("fleet up: NATS", timeout=180)
        assert (folder / "nats.conf").is_file()
        async with httpx.AsyncClient(base_url=base, timeout=180) as http:
            chat = await http.post("/v1/chat/completions", json=CHAT)
            assert chat.status_code == 200, chat.text
            assert chat.json()["usage"]["completion_tokens"] == 4
            made = await http.post("/v1/images/generations", json=IMAGE)
            assert made.status_code == 200, made.text
            url = made.json()["data"][0]["url"]
            image = await http.get(url)
            assert image.status_code == 200
            assert hashlib.sha256(image.content).hexdigest() == url.rsplit("/", 1)[1]
            health = await http.get("/healthz")
            assert health.status_code == 200, health.text
        client = await connect_as(folder, "client", nats_port)
        try:
            events = await run_task(client, hello("secured-client-task"), timeout=120)
            assert isinstance(events[-1], TaskFinished)
            assert events[-1].status == "completed"
            # An ask: the client role may ask, the worker role may answer it.
            asked = await client.request("fleet.ask.tiny-llm", b"hi", timeout=120)
            answer = decode_with(ASK_REPLY, asked.data)
            assert isinstance(answer, AskAnswer) and answer.status == "completed", answer
            # An input image, as a client provides one: a worker stores it (fleet.images.put).
            upload = b"\x89PNG\r\n\x1a\n an input image"
            stored = await upload_image(client, upload)
            assert stored.sha256 == hashlib.sha256(upload).hexdigest()
        finally:
            await client.close()
        assert_clean(up, *up.terminate_and_time())
    finally:
        up.kill()
    log = up.log()
    assert "permission denied" not in log.lower(), log[-3000:]
    assert "violation" not in (data / "nats.log").read_text().lower()
