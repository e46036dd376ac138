"""How many tasks a text runner batches by default: what its engine can batch, within memory.

mlx-lm's BatchGenerator decodes up to ENGINE_BATCH sequences in one step (its own default
completion batch size); every admitted task holds a KV cache that grows to its context. So
the default is ENGINE_BATCH, less where KV_SHARE of the node's free memory, after the model's
weights, cannot hold that many full-context caches. A fixed 4 queued the 5th concurrent client
of a 135M model behind the first four while mlx_lm.server batched them all (issue 23).
"""

from __future__ import annotations

from fleet.wire.cluster import ModelCard

ENGINE_BATCH = 32  # mlx-lm 0.32's BatchGenerator completion_batch_size
EMBEDDING_BATCH = 256  # requests an embedding runner takes at once (fleet/runner/embed.py)
KV_SHARE = 0.5  # of the memory left after the weights: the rest is the process's and the OS's
KV_BYTES_PER_VALUE = 4  # float32 on the CPU (the widest the engine keeps a cache in)
# A task's cache is sized at this many tokens (or the model's context, if shorter): the cache
# grows as a task goes, few use a long context whole, and sizing every slot at 8k tokens gave
# SmolLM2-135M 7 slots on a 16 GB node, fewer than mlx_lm.server's 32.
SIZED_TOKENS = 2048


def kv_bytes_per_task(card: ModelCard) -> int:
    """A task's KV cache at SIZED_TOKENS (keys and values, every layer, every hidden unit: an
    upper bound, as grouped-query attention keeps fewer); 0 when the card does not say."""
    if card.n_layers <= 0 or card.hidden_size <= 0:
        return 0
    context = min(card.context_length, SIZED_TOKENS)
    return 2 * card.n_layers * card.hidden_size * KV_BYTES_PER_VALUE * context


def default_batch_width(card: ModelCard, free_memory_bytes: int) -> int:
    """The slots of a runner placed without an explicit count (images run one at a time)."""
    if card.is_image:
        return 1
    if card.is_embedding:
        return EMBEDDING_BATCH  # no cache is held between passes: width costs no memory
    per_task = kv_bytes_per_task(card)
    if per_task == 0 or free_memory_bytes <= 0:
        return ENGINE_BATCH
    room = (free_memory_bytes - card.size_bytes) * KV_SHARE
    return max(1, min(ENGINE_BATCH, int(room // per_task)))
