"""A prompt as a chain of block hashes: the compact form in which prefixes are compared.

The worker has no tokenizer (runners load it), so blocks are cut from a canonical rendering
of the request, not from token ids: the tools, then each message as canonical JSON, in order.
A conversation's next turn is its previous prompt plus new messages, so its rendering starts
with the previous one and shares its leading blocks. Block i's hash covers block i and the
hash of block i-1, so equal hashes mean equal prefixes and "how much of this prompt does a
runner hold" is the number of leading blocks it knows. Only whole blocks count; a prompt
shorter than one block has none and routes by load alone.

A task with a session (TextGeneration.session) starts with one block naming the session:
its turns share that block with each other and with no other conversation, so they go back
to the runner that served them even when the prompt is short or a turn rewrites the start of
its history, and a system prompt that many sessions share no longer pulls them all to one
runner (each session is its own prefix).
"""

from __future__ import annotations

import hashlib

import orjson

from fleet.wire.tasks import Task, TextGeneration

BLOCK_CHARS = 256  # ~60-250 tokens: fine enough for turns, a few dozen hashes per prompt


def rendering(task: TextGeneration) -> bytes:
    parts = [orjson.dumps([t.model_dump(mode="json") for t in task.tools or []])]
    if task.prompt is not None:
        parts.append(task.prompt.encode())
    for message in task.messages or []:
        parts.append(orjson.dumps(message.model_dump(mode="json", exclude_none=True)))
    return b"\n".join(parts)


def block_hashes(data: bytes, block: int = BLOCK_CHARS) -> tuple[int, ...]:
    hashes: list[int] = []
    previous = b""
    for start in range(0, len(data) - block + 1, block):
        digest = hashlib.blake2b(previous + data[start:start + block], digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "big"))
        previous = digest
    return tuple(hashes)


def session_block(session: str) -> bytes:
    """One whole block that names a session (and nothing a rendering could start with)."""
    name = hashlib.blake2b(session.encode(), digest_size=32).hexdigest().encode()
    return (b"\0session " + name).ljust(BLOCK_CHARS, b"\0")


def prompt_blocks(task: Task) -> tuple[int, ...]:
    """The block hashes of a text task's prompt, after its session's block if it has one;
    none for images (no prefix cache)."""
    if not isinstance(task, TextGeneration):
        return ()
    head = session_block(task.session) if task.session else b""
    return block_hashes(head + rendering(task))
