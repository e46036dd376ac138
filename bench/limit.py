"""The limit: plain mlx-lm in a process of its own, on the same model directory.

One stream runs through `mlx_lm.stream_generate`, N streams through mlx-lm's BatchGenerator
with all N inserted at once and its default batch sizes; closed-loop clients through one
BatchGenerator too, each client's next request inserted as its previous one finishes. Times
are taken inside that process from the moment a request is handed over (before its chat
template is applied), so no transport of any kind is counted: nothing can be faster on this
machine with this mlx-lm.

The benchmark talks to it over JSON lines: `python -m bench.limit MODEL_DIR` answers a
`ready` line (its pid, the model's end-of-sequence ids, the BLAS it loaded), then one line of
results per `{"op": "burst", "requests": [...]}` or `{"op": "clients", "queues": [[...]]}` line.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from bench.workload import Request, StreamResult

READY_TIMEOUT_S = 300.0


class LimitPath:
    """The client side: a `bench.limit` subprocess driven over its pipes."""

    name = "limit"

    def __init__(self, model_dir: Path, env: dict[str, str], log_path: Path) -> None:
        self.model_dir = model_dir
        self.env = env
        self.log_path = log_path
        self.process: asyncio.subprocess.Process | None = None
        self.info: dict[str, Any] = {}

    async def start(self) -> dict[str, Any]:
        began = time.perf_counter()
        with self.log_path.open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.limit", str(self.model_dir),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log,
                env=self.env, limit=2**24,
            )
        self.info = await asyncio.wait_for(self._read(), READY_TIMEOUT_S)
        self.info["startup_s"] = time.perf_counter() - began
        return self.info

    async def _read(self) -> dict[str, Any]:
        assert self.process is not None and self.process.stdout is not None
        line = await self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the limit process ended; see {self.log_path}")
        data: dict[str, Any] = json.loads(line)
        return data

    async def burst(self, requests: list[Request]) -> list[StreamResult]:
        assert self.process is not None and self.process.stdin is not None
        line = json.dumps({"op": "burst", "requests": [r.to_json() for r in requests]})
        self.process.stdin.write(line.encode() + b"\n")
        await self.process.stdin.drain()
        answer = await self._read()
        return [StreamResult.from_json(r) for r in answer["results"]]

    async def clients(self, queues: list[list[Request]]) -> list[StreamResult]:
        assert self.process is not None and self.process.stdin is not None
        line = json.dumps({"op": "clients",
                           "queues": [[r.to_json() for r in queue] for queue in queues]})
        self.process.stdin.write(line.encode() + b"\n")
        await self.process.stdin.drain()
        answer = await self._read()
        return [StreamResult.from_json(r) for r in answer["results"]]

    async def stop(self) -> None:
        if self.process is None or self.process.returncode is not None:
            return
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 10)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


# ---- the subprocess ------------------------------------------------------------------------


class _Engine:
    def __init__(self, model_dir: str) -> None:
        from mlx_lm import load

        loaded = load(model_dir)  # (model, tokenizer); a config too only when asked
        self.model, self.tokenizer = loaded[0], loaded[1]

    def _tokens(self, request: Request) -> list[int]:
        template = self.tokenizer.apply_chat_template
        return list(template(request.messages, add_generation_prompt=True))

    def one(self, request: Request) -> StreamResult:
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_logits_processors

        start = time.perf_counter()
        tokens = self._tokens(request)
        result = StreamResult(start_s=0.0, prompt_tokens=len(tokens))
        processors = make_logits_processors(logit_bias=request.logit_bias)
        for _ in stream_generate(self.model, self.tokenizer, tokens,
                                 max_tokens=request.max_tokens, logits_processors=processors):
            now = time.perf_counter() - start
            result.first_s = now if result.first_s is None else result.first_s
            result.last_s = now
            result.tokens += 1
        return result

    def many(self, requests: list[Request]) -> list[StreamResult]:
        from mlx_lm.generate import BatchGenerator
        from mlx_lm.sample_utils import make_logits_processors

        start = time.perf_counter()
        prompts = [self._tokens(r) for r in requests]
        generator = BatchGenerator(self.model)
        try:
            uids = generator.insert(
                prompts,
                max_tokens=[r.max_tokens for r in requests],
                logits_processors=[make_logits_processors(logit_bias=r.logit_bias)
                                   for r in requests],
            )
            results = {uid: StreamResult(start_s=0.0, prompt_tokens=len(p))
                       for uid, p in zip(uids, prompts, strict=True)}
            running = set(uids)
            while running:
                _, responses = generator.next()
                now = time.perf_counter() - start
                for response in responses:
                    result = results[response.uid]
                    result.first_s = now if result.first_s is None else result.first_s
                    result.last_s = now
                    result.tokens += 1
                    if response.finish_reason is not None:
                        running.discard(response.uid)
        finally:
            generator.close()
        return [results[uid] for uid in uids]

    def burst(self, requests: list[Request]) -> list[StreamResult]:
        return [self.one(requests[0])] if len(requests) == 1 else self.many(requests)

    def clients(self, queues: list[list[Request]]) -> list[StreamResult]:
        """Closed-loop clients on one BatchGenerator: each client's next request is inserted
        (and its clock started) as its previous one finishes. Results in queue order."""
        from mlx_lm.generate import BatchGenerator
        from mlx_lm.sample_utils import make_logits_processors

        start = time.perf_counter()
        pending = [list(queue) for queue in queues]
        results: list[list[StreamResult]] = [[] for _ in queues]
        running: dict[int, StreamResult] = {}
        client_of: dict[int, int] = {}
        generator = BatchGenerator(self.model)

        def submit(client: int) -> None:
            request = pending[client].pop(0)
            result = StreamResult(start_s=time.perf_counter() - start)
            prompt = self._tokens(request)
            result.prompt_tokens = len(prompt)
            (uid,) = generator.insert(
                [prompt], max_tokens=[request.max_tokens],
                logits_processors=[make_logits_processors(logit_bias=request.logit_bias)],
            )
            running[uid], client_of[uid] = result, client
            results[client].append(result)

        try:
            for client in range(len(queues)):
                if pending[client]:
                    submit(client)
            while running:
                _, responses = generator.next()
                now = time.perf_counter() - start
                for response in responses:
                    result = running[response.uid]
                    result.first_s = now if result.first_s is None else result.first_s
                    result.last_s = now
                    result.tokens += 1
                    if response.finish_reason is not None:
                        del running[response.uid]
                        if pending[client := client_of.pop(response.uid)]:
                            submit(client)
        finally:
            generator.close()
        return [result for client in results for result in client]


def _commands(stdin: BinaryIO) -> Iterator[dict[str, Any]]:
    for line in stdin:
        if line.strip():
            yield json.loads(line)


def main(model_dir: str) -> int:
    # Results go to a private copy of stdout; anything printed by a library lands on stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from fleet.models.blas import enable_openblas

    blas = enable_openblas()
    engine = _Engine(model_dir)
    warm = Request([{"role": "user", "content": "Hello"}], 4, {})
    engine.burst([warm])
    engine.burst([warm, warm])
    eos = sorted(engine.tokenizer.eos_token_ids)
    out.write(json.dumps({"op": "ready", "pid": os.getpid(), "eos_ids": eos, "blas": blas}) + "\n")
    for command in _commands(sys.stdin.buffer):
        if command.get("op") == "burst":
            results = engine.burst([Request.from_json(r) for r in command["requests"]])
            out.write(json.dumps({"results": [r.to_json() for r in results]}) + "\n")
        elif command.get("op") == "clients":
            results = engine.clients([[Request.from_json(r) for r in queue]
                                      for queue in command["queues"]])
            out.write(json.dumps({"results": [r.to_json() for r in results]}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
