"""A prompt as a chain of block hashes: the compact form in which prefixes are compared.

The worker has no tokenizer (runners load it), so blocks are cut from a canonical rendering
of the request, not from token ids: the tools, then each message as canonical JSON, in order.
A conversation's next turn is its previous prompt plus new messages, so its rendering starts
with the previous one and shares its leading blocks. Block i's hash covers block i and the
hash of block i-1, so equal hashes mean equal prefixes and "how much of this prompt does a
runner hold" is the number of leading blocks it knows. Only whole blocks count; a prompt
shorter than one block has none and routes by load alone.
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


def prompt_blocks(task: Task) -> tuple[int, ...]:
    """The block hashes of a text task's prompt; none for images (no prefix cache)."""
    if not isinstance(task, TextGeneration):
        return ()
    return block_hashes(rendering(task))
