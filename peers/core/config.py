"""Config dataclasses of the peer runtime, checked when built. CLIs only map flags onto these."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from peers.core.ids import DTYPES
from peers.core.trainers import TrainerPolicy
from swarm.compression import Codec
from swarm.nat import NatOptions

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "fusionswarm"
LOCAL_HOST_MADDRS = ("/ip4/127.0.0.1/tcp/0",)


def parse_block_indices(text: str) -> tuple[int, int]:
    """``"2:6"`` -> ``(2, 6)``."""
    try:
        start, end = (int(x) for x in text.split(":"))
    except ValueError as e:
        raise ValueError(f"--block_indices must look like START:END (e.g. 0:4), got {text!r}") from e
    if not 0 <= start < end:
        raise ValueError(f"--block_indices {text!r}: need 0 <= START < END")
    return start, end


@dataclass(kw_only=True)
class SwarmConfig:
    """How to reach the swarm: bootstrap addresses and this node's listen/announce addresses."""

    initial_peers: tuple[str, ...] = ()  # full multiaddrs /ip4/.../tcp/PORT/p2p/PEER_ID printed by `swarm dht`
    host_maddrs: tuple[str, ...] = LOCAL_HOST_MADDRS  # where to listen; /ip4/0.0.0.0/tcp/PORT to accept others
    announce_maddrs: tuple[str, ...] = ()  # public addresses to announce (behind NAT / port forwarding)
    identity_path: Path | None = None  # Ed25519 key file (0600): the peer id is its public key, kept across restarts
    credentials_path: Path | None = None  # private swarm: member credentials from `swarm invite` (--private)
    revocation_path: Path | None = None  # private swarm: a revocation file from `swarm revoke` (also spread by the DHT)
    new_swarm: bool = False  # start a new swarm instead of joining one
    dht_timeout: float = 10.0  # seconds for one DHT lookup or store
    # NAT and relays (swarm.nat): the defaults suit a home peer; `swarm dht` forces "public" (it relays for others)
    use_relay: bool = True  # dial peers behind NAT through relays, and relay for others
    use_auto_relay: bool = True  # behind NAT, serve through slots on `relays` (only nodes that serve take slots)
    force_reachability: str | None = None  # "public" | "private": skip the reachability check; None: check
    relays: tuple[str, ...] = ()  # trusted relays (full multiaddrs); default: the initial peers
    client_mode: bool = False  # a DHT client that only dials out (clients and trainers always are)
    check_reachability: bool = True  # a serving peer asks its initial peers to dial it back before it joins
    # with no initial peers, find the swarm on the LAN (a peer: else refused, unless ``new_swarm``) and advertise
    # there (peers, bootstrap peers; a client only listens): ``swarm.lan``
    mdns: bool = True

    def __post_init__(self) -> None:
        self.initial_peers = tuple(self.initial_peers)
        for maddr in self.initial_peers:
            if "/p2p/" not in maddr:
                raise ValueError(
                    f"initial peer {maddr!r} lacks /p2p/PEER_ID; "
                    "copy the whole --initial_peers line that `swarm dht` printed"
                )
        if self.new_swarm and self.initial_peers:
            raise ValueError("use either --new_swarm or --initial_peers, not both")
        if self.dht_timeout <= 0:
            raise ValueError("dht_timeout must be positive")
        if self.credentials_path is not None and self.identity_path is None:
            raise ValueError("--private needs --identity_path: the identity file whose key the invite certifies")
        if self.revocation_path is not None and self.credentials_path is None:
            raise ValueError("--revocations applies to a private swarm: pass --private CREDENTIALS too")
        self.relays = tuple(self.relays)
        self.nat()  # checks the relay options

    @property
    def lan(self) -> bool:
        """Whether this node finds the swarm on the LAN (mDNS): none of ``initial_peers`` given, ``mdns`` on, and a
        public swarm (a private swarm's nodes advertise nothing on the LAN)."""
        return self.mdns and not self.initial_peers and self.credentials_path is None

    def nat(self) -> NatOptions:
        """The relay and NAT options of this node's p2p daemon."""
        return NatOptions(use_relay=self.use_relay, use_auto_relay=self.use_auto_relay,
                          force_reachability=self.force_reachability, relays=self.relays)


@dataclass(kw_only=True)
class StageServerConfig:
    """One stage peer: which model and blocks, where, and its limits."""

    model_dir: Path
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    model_name: str | None = None  # DHT name of the model; default: the folder's name
    block_indices: tuple[int, int] | None = None  # serve exactly these blocks [start, end)
    num_blocks: int | None = None  # or serve this many, chosen where the swarm is weakest
    device: str = "cpu"
    torch_dtype: str = "float32"  # float32 | float16 | bfloat16 | auto (the checkpoint's)
    public_name: str = ""
    max_batch_size: int = 8  # rows per request
    max_batch_tokens: int = 2048  # tokens per batched forward (requests that arrive together are combined)
    max_request_bytes: int = 64 << 20  # larger requests are refused
    probe_max_bytes: int = 16 << 20  # the largest transfer of our link probes (--probe_max_mib; see peers.wire.probe)
    request_timeout: float = 60.0  # seconds: deadline of one RPC on this peer
    update_period: float = 15.0  # seconds between announcements; a record expires after ~2 periods
    throughput: float | None = None  # tokens/s per block; None: measure once and cache
    retime_every: float = 300.0  # seconds between idle re-timings of a block (peers.server.retiming); 0: never
    cache_dir: Path = DEFAULT_CACHE_DIR
    cache_tokens: int = 16384  # inference KV cache budget: batch rows x max_length summed over sessions
    session_timeout: float = 60.0  # seconds an idle or disconnected session keeps its cache
    client_cache_share: float = 0.5  # of cache_tokens one client may always hold; more only while nobody waits
    cache_wait: float = 2.0  # seconds an open that does not fit waits for space before it is refused
    require_encryption: bool = True  # refuse inference streams that skip the handshake (plaintext tensors)
    trainers: tuple[str, ...] = ()  # who may train (and so change) the served weights: peer ids, "members", "anyone"
    checkpoint_dir: Path | None = None  # training: save/resume weights + AdamW state of our blocks here
    # who may train LoRA adapters of their own on our frozen blocks (issue 19): "anyone" (default), "members", peer
    # ids, or "none"; base training stays with ``trainers``
    adapters: str = "anyone"
    # moves (``StageServer.move_to`` / ``become_backup``): start as a backup (no blocks, ready to take a place),
    # the blocks memory holds (announced; None: from free memory), whether a plan's follower may move this peer,
    # and a local unix socket that takes `move START:END` / `backup` lines from this machine's user
    backup: bool = False
    max_blocks: int | None = None
    follow_plans: bool = True
    organise: bool = False  # take part in the swarm-wide plan (private: the broker's; public: its own), not only runs'
    control_socket: Path | None = None
    metrics_port: int = 0  # Prometheus /metrics on this port (``peers.server.metrics``); 0: off
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        self.model_dir = Path(self.model_dir)
        if not (self.retime_every >= 0 and self.retime_every != float("inf")):
            raise ValueError(f"--retime_every must be >= 0 seconds (0: never), got {self.retime_every}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics_port must be in 0..65535 (0: off), got {self.metrics_port}")
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"{self.model_dir} has no config.json: pass a Hugging Face model folder")
        if self.backup and (self.block_indices is not None or self.num_blocks is not None):
            raise ValueError("--backup starts with no blocks: drop --block_indices / --num_blocks")
        if not self.backup and (self.block_indices is None) == (self.num_blocks is None):
            raise ValueError("pass exactly one of --block_indices START:END or --num_blocks N (or --backup)")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("--num_blocks must be >= 1")
        if self.max_blocks is not None:
            serving = self.num_blocks or (self.block_indices[1] - self.block_indices[0] if self.block_indices else 0)
            if not 1 <= self.max_blocks or self.max_blocks < serving:
                raise ValueError(f"--max_blocks {self.max_blocks} must be >= 1 and at least the {serving} block(s) "
                                 f"this peer serves")
        if self.control_socket is not None:
            self.control_socket = Path(self.control_socket)
        if self.torch_dtype not in (*DTYPES, "auto"):
            raise ValueError(f"--torch_dtype must be one of {[*DTYPES, 'auto']}, got {self.torch_dtype!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: CUDA is not available on this machine; use --device cpu")
        if not self.swarm.new_swarm and not self.swarm.initial_peers and not self.swarm.lan:
            raise ValueError("pass --initial_peers (the line `swarm dht` printed) or --new_swarm to start a swarm"
                             + (" (a private swarm is never found on the LAN)" if self.swarm.mdns else
                                " (or drop --no_mdns to find the swarm on the LAN)"))
        for name in ("max_batch_size", "max_batch_tokens", "max_request_bytes", "request_timeout", "update_period",
                     "cache_tokens", "session_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not 0 < self.client_cache_share <= 1:
            raise ValueError("--client_cache_share must be in (0, 1]")
        if not 0 <= self.cache_wait < self.request_timeout:
            raise ValueError("--cache_wait must be >= 0 and below --request_timeout")
        self.cache_dir = Path(self.cache_dir)
        self.trainers = self.trainer_policy().trainers  # checked: peer ids, or 'members' in a private swarm
        try:
            self.adapter_policy()
        except ValueError as e:
            raise ValueError(f"--adapters: {e}".replace("--trainers", "--adapters")) from None

    def adapter_policy(self) -> TrainerPolicy:
        """Who may open adapter runs here (``--adapters``; ``none``: nobody)."""
        who = () if self.adapters.strip().lower() == "none" else (self.adapters,)
        return TrainerPolicy(who, private=self.swarm.credentials_path is not None)

    def trainer_policy(self) -> TrainerPolicy:
        """Who may train this peer (``peers.core.trainers``): nobody unless the operator passed ``--trainers``."""
        return TrainerPolicy(self.trainers, private=self.swarm.credentials_path is not None)


TOPOLOGIES = ("chain", "star")


@dataclass(kw_only=True)
class ClientConfig:
    """A client of the swarm: embeddings and head run locally, blocks on peers."""

    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    model_name: str | None = None
    device: str = "cpu"  # or "auto": cuda when present (``peers.core.devices``)
    torch_dtype: str = "float32"  # or "auto": float32 on the CPU, the checkpoint's dtype on a GPU
    # a ``swarm train`` run's trainer checkpoint (CHECKPOINT_DIR/<run_id>[/trainer]): its trained embedding + head run
    # here instead of the model folder's (the blocks are the ones the peers serve, trained by the run)
    checkpoint: Path | None = None
    request_timeout: float = 30.0  # seconds per RPC
    step_timeout_factor: float = 25.0  # a generation step times out after this many typical step times ...
    min_step_timeout: float = 1.0  # ... but never sooner than this many seconds (nor later than request_timeout)
    max_retries: int = 5  # re-routes of one call before giving up
    refresh_period: float = 5.0  # seconds between DHT snapshots
    ban_time: float = 2.0  # first ban of a failing peer, doubled on each failure
    max_ban_time: float = 60.0
    encrypt: bool = True  # end-to-end encrypt inference streams (X25519 handshake with each peer, AES-GCM)
    local_blocks: int = 0  # run the first N blocks here too: peers never see the earliest activations
    allowed_peers: tuple[str, ...] = ()  # if set, only these peer ids compute for this client
    blocked_peers: tuple[str, ...] = ()  # these peer ids never compute for this client
    # "chain": each peer pushes its output straight to the next one (the client's link carries the first input and
    # the last output only); "star": every hidden state goes through the client (peers never talk to each other)
    topology: str = "chain"
    # how hidden states travel in inference (``swarm.compression``): "none" (bit-exact, default) or a lossy codec,
    # "fp16", "bf16", "int8", "topk:0.5/fp16": the client's inputs to peers, their outputs back and their pushes
    compression: str = "none"
    # LoRA adapters the peers run this client's requests with (``peers.client.adapters``): the run id of this
    # identity's adapter run, or an exported peft folder; "": the base model
    adapter: str = ""

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {list(TOPOLOGIES)}, got {self.topology!r}")
        self.codec  # noqa: B018 - checks ``compression`` (ValueError saying what it takes)
        if self.torch_dtype not in (*DTYPES, "auto"):
            raise ValueError(f"torch_dtype must be one of {[*DTYPES, 'auto']}, got {self.torch_dtype!r}")
        if self.request_timeout <= 0 or self.max_retries < 0:
            raise ValueError("request_timeout must be positive and max_retries >= 0")
        if self.local_blocks < 0:
            raise ValueError("local_blocks must be >= 0")
        self.allowed_peers, self.blocked_peers = tuple(self.allowed_peers), tuple(self.blocked_peers)
        if not all(isinstance(p, str) and p for p in self.allowed_peers + self.blocked_peers):
            raise ValueError("allowed_peers and blocked_peers must be peer ids (strings)")
        if set(self.allowed_peers) & set(self.blocked_peers):
            raise ValueError("a peer cannot be both allowed and blocked")
        if self.step_timeout_factor <= 1 or self.min_step_timeout <= 0:
            raise ValueError("step_timeout_factor must be > 1 and min_step_timeout positive")

    @property
    def codec(self) -> Codec:
        """``compression`` as a ``Codec``."""
        return Codec.parse(self.compression)
