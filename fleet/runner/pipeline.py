"""One rank of a pipeline-parallel llama-family model (llama, qwen2): its layers only.

mlx-lm 0.32.2 gives llama and qwen2 tensor sharding but no pipeline of their own. Rank r runs
layers [start, end): rank 0 embeds the tokens and runs the first layers, each rank receives
the hidden state from the rank before it and sends its output to the rank after it, and the
last rank's output is gathered by every rank, which applies the final norm and the head. So
every rank computes the same logits, samples the same token, and keeps its batch and caches
in step with the others. The layers of other ranks are dropped before their (lazy) weights
are read, so a rank holds only its share of the model.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

PIPELINED = ("llama", "qwen2")


class PipelineRank(nn.Module):
    def __init__(self, model: Any, ring: Any, start: int, end: int) -> None:
        super().__init__()
        model_type = getattr(model, "model_type", "")
        if model_type not in PIPELINED:
            raise ValueError(f"no pipeline for {model_type or 'this'} model: only "
                             f"{', '.join(PIPELINED)}")
        layers = model.model.layers
        if not 0 <= start < end <= len(layers):
            raise ValueError(f"layers {start}-{end} are not within the model's {len(layers)}")
        if any(getattr(layer, "use_sliding", False) for layer in layers):
            raise ValueError("sliding-window layers are not pipelined")
        self.model = model
        # Keep the layer numbers (weights are named by them); drop the other ranks' layers.
        model.model.layers = [
            layer if start <= index < end else None for index, layer in enumerate(layers)
        ]
        self.start, self.end = start, end
        self.rank, self.size = ring.rank(), ring.size()
        self._ring = ring

    @property
    def layers(self) -> list[Any]:
        """This rank's layers: its caches are theirs."""
        return self.model.model.layers[self.start:self.end]

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.layers]

    def __call__(
        self, inputs: mx.array, cache: list[Any] | None = None,
        input_embeddings: mx.array | None = None,
    ) -> mx.array:
        inner = self.model.model
        h = inner.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        if self.rank > 0:
            h = mx.distributed.recv_like(h, self.rank - 1, group=self._ring)
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h = layer(h, mask, cache=layer_cache)
        if self.rank < self.size - 1:
            h = mx.distributed.send(h, self.rank + 1, group=self._ring)
            if cache[-1] is not None:
                # A prefill chunk evaluates the caches alone: the send must be in their graph,
                # or the next rank would wait for it for ever.
                cache[-1].keys = mx.depends(cache[-1].keys, h)
        # Every rank takes the last rank's output, keeping its own send in the graph.
        h = mx.distributed.all_gather(h, group=self._ring)[-h.shape[0]:]
        h = inner.norm(h)
        if self.model.args.tie_word_embeddings:
            return inner.embed_tokens.as_linear(h)
        return self.model.lm_head(h)
