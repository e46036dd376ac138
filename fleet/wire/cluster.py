"""Cluster state (KV buckets FLEET_NODES, FLEET_CAPABILITIES, FLEET_INSTANCES, FLEET_RUNNERS)
and `fleet.events.>`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from fleet.wire.base import InstanceId, ModelId, NodeId, Part, RunnerId, Wire
from fleet.wire.runners import RunnerStatus

ModelTask = Literal[
    "text_generation", "text_to_image", "image_to_image", "embeddings", "image_text_to_text"
]


class ImageDefaults(Part):
    steps: int = 4
    guidance: float = 1.0
    size: str = "512x512"


class EmbeddingSpec(Part):
    """How an embedding runner makes one vector of a text from the model's last hidden
    states (fleet/runner/embed_pooling.py)."""

    pooling: Literal["mean", "last"] = Field(
        default="mean", description="mean: the average over the text's tokens (padding left "
        "out); last: the hidden state of its last token",
    )
    normalize: bool = Field(default=True, description="scale each vector to unit L2 length")
    dimensions: int = Field(ge=1, description="the length of a vector (the hidden size)")
    truncatable: bool = Field(
        default=False, description="trained so that a vector's first k dimensions are an "
        "embedding too (Matryoshka): a request's `dimensions` below the model's is served by "
        "cutting and normalising again. Otherwise such a request is refused (400)",
    )

    def refuses_dimensions(self, dimensions: int | None) -> str | None:
        """Why vectors of `dimensions` cannot be given (None: they can)."""
        if dimensions is None or dimensions == self.dimensions:
            return None
        if dimensions > self.dimensions:
            return f"dimensions: {dimensions} is more than the model's {self.dimensions}"
        if not self.truncatable:
            return (f"dimensions: this model's vectors have {self.dimensions} dimensions and "
                    "cannot be shortened (its card does not say it was trained to be cut)")
        return None


class WeightFile(Part):
    """One file of a model, stored in FLEET_WEIGHTS under the sha256 hex of its bytes."""

    path: str = Field(description="Relative path inside the model directory")
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class WeightsManifest(Part):
    """The files that make up a model directory, as published to the fleet."""

    files: list[WeightFile] = Field(default_factory=list)
    total_bytes: int = 0
    revision: str = Field(default="", description="sha256 over the files' paths and hashes")
    architecture: str = ""


class ModelCard(Wire):
    """What a model is and where its weights come from; the tasks choose the runner kind."""

    type: Literal["model_card"] = "model_card"
    id: ModelId
    name: str
    tasks: list[ModelTask] = Field(min_length=1)
    family: str = Field(description="Loader family: mlx_lm, gguf_llama, mflux_flux2, mflux_flux1…")
    source: str = Field(description="Where weights come from: a path, an HF repo id, or 'built-in'")
    size_bytes: int = 0
    shared_bytes: int = Field(
        default=0, description="Bytes of the weights outside the layers (embedding, final "
        "norm, head): every rank of a sharded instance holds them whole. 0: not known, "
        "spread over the layers",
    )
    n_layers: int = 0
    hidden_size: int = 0
    context_length: int = 2048
    quantization: str = "none"
    capabilities: list[Literal["tools", "vision", "partial_images"]] = Field(default_factory=list)
    aliases: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list,
        description="Other names a request may give for this model, on every API (a "
        "client's own default, e.g. claude-sonnet-4-5); `*` matches any run of characters "
        "(claude-*). A model's own id wins over an alias, an exact alias over a pattern",
    )
    image_defaults: ImageDefaults | None = None
    embedding: EmbeddingSpec | None = Field(
        default=None, description="An embeddings model: how its vectors are made"
    )
    manifest: WeightsManifest | None = Field(
        default=None, description="The model's files in FLEET_WEIGHTS, once published"
    )

    @property
    def is_image(self) -> bool:
        return "text_to_image" in self.tasks or "image_to_image" in self.tasks

    @property
    def is_embedding(self) -> bool:
        return "embeddings" in self.tasks

    @property
    def is_vision(self) -> bool:
        """A chat model that reads images (mlx-vlm): the vision runner kind serves it."""
        return "image_text_to_text" in self.tasks

    @property
    def embedding_spec(self) -> EmbeddingSpec:
        """How this model's vectors are made: its card's, else mean pooling, normalised."""
        return self.embedding or EmbeddingSpec(dimensions=max(self.hidden_size, 1))


class DeviceInfo(Part):
    kind: Literal["cpu", "gpu", "metal"]
    name: str
    memory_bytes: int = 0


class NodeInfo(Wire):
    """The heartbeat a worker puts in FLEET_NODES under its node id; the key's TTL is its life."""

    type: Literal["node_info"] = "node_info"
    node_id: NodeId
    hostname: str
    memory_total_bytes: int
    memory_available_bytes: int
    cpu_count: int
    devices: list[DeviceInfo] = Field(default_factory=list)
    models_on_disk: list[ModelId] = Field(default_factory=list)
    models_available: list[ModelId] = Field(
        default_factory=list,
        description="Models this node can load: on disk, or built or converted here offline",
    )
    models_disk_room_bytes: int | None = Field(
        default=None, ge=0,
        description="Bytes of model files this node can still take under its disk budget, "
        "evicting every model not placed on it; null: no budget",
    )
    runners: list[RunnerId] = Field(default_factory=list)
    ring_address: str | None = Field(
        default=None,
        description="host:port where this node's shard of a sharded instance joins its ring "
        "(mx.distributed); null: this node takes no shards",
    )
    blas: str | None = None
    standby_runner: bool = Field(
        default=False,
        description="A runner process with a text runner's imports done waits here for a job: "
        "a runner started here skips them (fleet/worker/standby.py)",
    )
    held_acks: list[str] = Field(
        default_factory=list,
        description="Ack subjects of the FLEET_TASKS deliveries this node holds: the sweeper "
        "naks them when the node is seen dead (fleet/worker/deathwatch.py)",
    )
    started_at: float
    at: float


class NodeCapabilities(Wire):
    """What a gateway needs of a live node, kept in FLEET_CAPABILITIES under `node.<node_id>`
    by the sweeper (fleet/worker/capabilities.py): the facts of its heartbeat that the
    gateway's answers read (which models it can provide, its memory and disk room, whether
    it takes shards), written when they change, not at every beat. Present while the
    sweeper counts the node alive; deleted when it sees the node gone."""

    type: Literal["node_capabilities"] = "node_capabilities"
    node_id: NodeId
    hostname: str
    memory_total_bytes: int
    memory_available_bytes: int = Field(
        description="As the node's heartbeat said when this record was written: rewritten "
        "when it moves by more than a step (fleet.worker.capabilities.MEMORY_STEP)",
    )
    cpu_count: int
    models_on_disk: list[ModelId] = Field(default_factory=list)
    models_available: list[ModelId] = Field(default_factory=list)
    models_disk_room_bytes: int | None = Field(default=None, ge=0)
    ring_address: str | None = None
    started_at: float


class CapabilitiesKeeper(Wire):
    """Who keeps FLEET_CAPABILITIES and when it last said so (key `keeper`): rewritten every
    few seconds by the sweeper, so a gateway tells a fleet with no worker left (nobody
    keeps the records, which then say nothing) from a quiet one."""

    type: Literal["capabilities_keeper"] = "capabilities_keeper"
    node_id: NodeId
    at: float = Field(description="Unix time in seconds of this write")


class ShardAssignment(Part):
    """One rank of an instance: which node runs which layers [start_layer, end_layer)."""

    node_id: NodeId
    runner_id: RunnerId
    rank: int = Field(default=0, ge=0)
    world_size: int = Field(default=1, ge=1)
    start_layer: int = Field(default=0, ge=0)
    end_layer: int = Field(default=0, ge=0)
    ring_address: str | None = Field(
        default=None, description="host:port of this rank in the group's ring (world_size > 1)"
    )


class Instance(Wire):
    """A placement of one model, kept in FLEET_INSTANCES under its instance id."""

    type: Literal["instance"] = "instance"
    instance_id: InstanceId
    model: ModelId
    shards: list[ShardAssignment] = Field(min_length=1)
    slots: int = Field(default=4, ge=1, le=256)
    created_at: float
    generation: int = Field(
        default=0, ge=0,
        description="a sharded instance's group restarts: bumped when a rank's runner dies, "
        "so every rank restarts into a fresh ring",
    )

    @property
    def sharded(self) -> bool:
        return len(self.shards) > 1

    def shard_on(self, node_id: str) -> ShardAssignment | None:
        return next((s for s in self.shards if s.node_id == node_id), None)


class RunnerRecord(Wire):
    """The current status of one runner, kept in FLEET_RUNNERS under its runner id."""

    type: Literal["runner_record"] = "runner_record"
    runner_id: RunnerId
    instance_id: InstanceId
    node_id: NodeId
    model: ModelId
    status: RunnerStatus
    slots: int = 1
    active_tasks: int = 0
    rank: int = Field(default=0, ge=0, description="its shard's rank in a sharded instance")
    at: float


class RunnerStatusChanged(Wire):
    type: Literal["runner_status_changed"] = "runner_status_changed"
    runner_id: RunnerId
    instance_id: InstanceId
    node_id: NodeId
    model: ModelId
    status: RunnerStatus
    at: float


class NodeJoined(Wire):
    type: Literal["node_joined"] = "node_joined"
    node_id: NodeId
    hostname: str
    at: float


class NodeLeft(Wire):
    type: Literal["node_left"] = "node_left"
    node_id: NodeId
    at: float


ClusterEvent = Annotated[
    RunnerStatusChanged | NodeJoined | NodeLeft,
    Field(discriminator="type"),
]
