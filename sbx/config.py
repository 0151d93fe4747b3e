"""Settings shared by every layer: sandbox sizes, paths on the host, network ranges.

Everything comes from defaults, then ``$SBX_CONFIG`` (a TOML file, default ``/etc/sbx/server.toml``), then
``SBX_*`` environment variables. Sizes follow the seed resize guide: small 2 vCPU / 4 GiB, default 4 / 8,
large 8 / 16, xlarge 16 / 32; disks 20 / 56 / 112 / 224 GiB. A test configuration shrinks the memory and disk
figures (``SBX_PROFILE=test``) so a 2-core, 24 GiB machine can run several sandboxes at once.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

SIZE_ORDER = ["small", "default", "large", "xlarge"]


@dataclass(frozen=True)
class Size:
    """One sandbox size: ``vcpus`` (CFS quota in whole CPUs), ``memory_mib`` (memory-cgroup limit, MiB),
    ``disk_mib`` (size of the sparse root disk image, MiB)."""

    name: str
    vcpus: int
    memory_mib: int
    disk_mib: int

    @property
    def memory_gb(self) -> float:
        """Memory in GiB as the API reports it (``memoryGB``): an int when whole, else a float."""
        gb = self.memory_mib / 1024
        return int(gb) if gb == int(gb) else round(gb, 3)

    @property
    def disk_gb(self) -> float:
        """Disk in GiB as the API reports it (``diskGB``)."""
        gb = self.disk_mib / 1024
        return int(gb) if gb == int(gb) else round(gb, 3)

    @property
    def pids_limit(self) -> int:
        """The sandbox's ``pids.max``: :data:`PIDS_PER_VCPU` tasks per vCPU (small 1024 ... xlarge 8192), so a fork
        bomb in a small sandbox holds few tasks for the host's scheduler to walk (issue 36: at 8192 tasks one small
        sandbox pushed a 2-core host's load to 441)."""
        return PIDS_PER_VCPU * self.vcpus

    @property
    def cpu_shares(self) -> int:
        """The sandbox's CPU weight (cgroup v1 ``cpu.shares``): :data:`SHARES_PER_VCPU` per vCPU, so sandboxes
        that contend for the node's CPUs get time in proportion to their size, on top of each one's CFS quota."""
        return SHARES_PER_VCPU * self.vcpus

    def rank(self) -> int:
        """Position in :data:`SIZE_ORDER`; resizing may only go up."""
        return SIZE_ORDER.index(self.name)


RUNTIME_CLASSES = ("container", "gvisor")
"""The runtime classes a sandbox can have: ``container`` (runc + CRIU: the host's kernel behind seccomp and a
shifted uid map) and ``gvisor`` (runsc: gVisor's own kernel; :mod:`sbx.runtime.runsc`)."""

PIDS_PER_VCPU = 512
"""Tasks a sandbox may hold per vCPU of its size (:attr:`Size.pids_limit`)."""
SHARES_PER_VCPU = 256
"""CPU weight per vCPU of a size (:attr:`Size.cpu_shares`; 1024, the kernel's default weight, is 4 vCPUs)."""

PRODUCTION_SIZES = {
    "small": Size("small", 2, 4 * 1024, 20 * 1024),
    "default": Size("default", 4, 8 * 1024, 56 * 1024),
    "large": Size("large", 8, 16 * 1024, 112 * 1024),
    "xlarge": Size("xlarge", 16, 32 * 1024, 224 * 1024),
}

# The test profile: the resize guide's task holds ~384 MiB in its heavy step, so small (256 MiB) OOMs and
# default (512 MiB) fits. Disks stay small so growing them is quick.
TEST_SIZES = {
    "small": Size("small", 2, 256, 2 * 1024),
    "default": Size("default", 4, 512, 3 * 1024),
    "large": Size("large", 8, 1024, 4 * 1024),
    "xlarge": Size("xlarge", 16, 2048, 5 * 1024),
}


@dataclass(frozen=True)
class Settings:
    """Where a node keeps its things and how the server listens.

    - ``home``: host-wide root (``/var/lib/sbx``): CRIU install, the reflink XFS data volume.
    - ``volume``: mount point of the reflink XFS volume; base images are cached in ``volume/images``.
    - ``node_name``: this node's folder on the volume (``volume/nodes/<node_name>``) and its name in network
      objects; two servers on one host need two names.
    - ``state_dir``: the server's own files (SQLite database, token, OCI bundles).
    - ``bridge`` / ``subnet``: the host bridge sandboxes attach to, and its IPv4 /16.
    - ``egress_allow``: comma-separated IPv4 CIDRs sandboxes may reach although the egress policy denies them by
      default (private, link-local, metadata and the host's networks; :mod:`sbx.node.network.egress`), e.g.
      ``"10.20.0.0/16,192.168.1.5"``. Empty by default. A bad item stops the server at start.
    - ``database_url``: a SQLAlchemy URL of a shared PostgreSQL database (psycopg 3), e.g.
      ``postgresql+psycopg://sbx@/sbx?host=/run/postgresql``; several server replicas may use one. Empty (the
      default): SQLite at ``state_dir/sbx.db``.
    - ``s3_endpoint`` / ``s3_bucket`` / ``s3_access_key`` / ``s3_secret_key``: an S3-compatible bucket for the data
      of persistent volumes (``SBX_S3_*``). No bucket (the default): a local directory store under ``volumes_dir``.
    - ``seal_store``: where stopped sandboxes' seals go so they outlive their node (:mod:`sbx.control.cluster.archive`):
      ``s3://BUCKET[/PREFIX]`` (with ``s3_endpoint``, ``s3_region`` and the ``s3_*`` credentials) or an absolute
      directory (``SBX_SEAL_STORE``). Empty (the default): seals stay on the nodes (and their replicas).
    """

    home: Path = Path("/var/lib/sbx")
    node_name: str = "node0"
    state_dir: Path = Path("/var/lib/sbx/server")
    bridge: str = "sbx0"
    subnet: str = "10.88.0.0/16"
    egress_allow: str = ""
    database_url: str = ""
    s3_endpoint: str = ""
    s3_bucket: str = ""
    s3_access_key: str = ""
    s3_secret_key: str = ""
    s3_region: str = ""
    seal_store: str = ""
    domain: str = "sbx.localhost"
    host: str = "127.0.0.1"
    port: int = 7070
    proxy_port: int = 7080
    ssh_gateway_port: int = 2222
    """Port of the SSH gateway (``ssh <sandbox id>@host -p 2222``, :mod:`sbx.api.sshgateway`) on ``host``; 0
    turns it off. Its host key is made on the first start under ``state_dir/ssh``."""
    egress_proxy_port: int = 7443
    """Port of the node's egress proxy (credential injection, :mod:`sbx.node.network.egressproxy`) on the bridge's
    gateway
    address; 0 turns the proxy off (binding a secret then fails with ``409 egress_proxy_unavailable``)."""
    egress_upstream_ca: str = ""
    """A CA file the egress proxy trusts for upstream servers instead of its default bundle (tests, private CAs)."""
    build_ca_file: str = ""
    """A PEM bundle that image builds' ``RUN`` steps trust (``SBX_BUILD_CA_FILE``): bound read-only over the image's
    ``/etc/ssl/certs/ca-certificates.crt`` while they run, never written into the image. For a network whose TLS goes
    through an inspecting proxy: give a full bundle that includes its CA (e.g. the host's own)."""
    profile: str = "production"
    volume_size_gib: int = 200
    auto_snapshot_seconds: int = 600
    auto_snapshot_keep: int = 3
    fork_default_ttl: int = 3600
    event_retention_seconds: int = 7 * 86400
    """How long lifecycle events (``GET /v1/sandboxes/{id}/events``) are kept; the reaper prunes older ones hourly."""
    require_memory_wait: float = 120.0
    """Seconds a ``require_memory`` resume waits for a host matching the memory image's CPU, kernel and CRIU
    before it fails with ``cpu_mismatch`` (issue 2; one node only matches again after an upgrade is undone)."""
    exec_channel: bool = True
    """Run attached execs through the sandbox's exec agent (:mod:`sbx.node.exec.channel`) when it answers; False: always
    ``runc exec`` (``SBX_EXEC_CHANNEL=0``). Either way the command's exit code, output and timeout are the same."""
    max_body_bytes: int = 1 << 20
    """Largest JSON request body the API takes (413 ``body_too_large`` above it); file uploads are not capped."""
    memory_reserve_mib: int = 1024
    """Host memory (MiB) kept out of every sandbox of a node together: the node's parent cgroup ``/sbx/<node>`` is
    capped at the host's RAM minus this (issue 17)."""
    memory_overcommit: float = 4.0
    """Admission (issue 17): ``new``, ``resume`` and ``fork`` are refused with ``507 insufficient_capacity`` when the
    memory limits of the node's sandboxes that are not stopped, plus the new one, would pass (host RAM -
    ``memory_reserve_mib``) x this ratio. 4.0 lets a 24 GiB host run ~360 idle test-profile small sandboxes (256
    MiB) or ~22 production small ones (4 GiB); see ``sbx.control.cluster.capacity``."""
    disk_reserve_gib: float = 5.0
    """Admission (issue 17): a sandbox is refused (``507 insufficient_capacity``) when the host filesystem under the
    data volume (or the volume itself) would keep less than this many GiB free after the new disk's likely growth."""
    disk_floor_gib: float = 2.0
    """A full host (issue 36, :mod:`sbx.control.cluster.diskguard`): below this many GiB free under the data volume the
    node stops its fastest-growing sandboxes (``stop_reason`` ``disk_full``); between it and ``disk_reserve_gib``
    it only refuses new work, pauses automatic snapshots and tells the sandboxes' owners (``disk_low`` events). Never
    above ``disk_reserve_gib`` (a reserve of 0 turns both off)."""
    disk_check_seconds: float = 5.0
    """Seconds between two checks of every node's free space by the disk guard (0 turns it off)."""
    trim_seconds: int = 30
    """Seconds between two ``fstrim`` passes of the data volume, which give the blocks it freed (deleted sandboxes,
    snapshots, memory images, discards from sandbox disks) back to the host's filesystem
    (:func:`sbx.storage.volume.trim_volume`); deletes also ask for one. 0 = only after deletes."""
    plans: dict[str, dict[str, object]] = field(default_factory=dict)
    """Plan table (issue 12), TOML ``[plans.<name>]`` with ``price_usd_month``, ``sizes`` (list), ``starts_per_hour``,
    ``running`` (concurrently running sandboxes), ``storage_gib`` (included storage); 0 = no limit; ``runtimes``
    (list of :data:`RUNTIME_CLASSES` its accounts may run; ``["gvisor"]`` requires the hardened class). Merged over
    the seed defaults in :data:`sbx.control.accounts.plans.DEFAULT_PLANS`."""
    default_runtime: str = "container"
    """The runtime class of a sandbox created without one (one of :data:`RUNTIME_CLASSES`; an account whose plan
    does not allow it gets its plan's first class). Another value stops the server at start."""
    pricing: dict[str, object] = field(default_factory=dict)
    """Price model (issue 12), TOML ``[pricing]``: ``model`` ``"size"`` (per-size hourly prices, ``hourly.<size>``)
    or ``"memory"`` (``memory_gib_hour`` per GiB-hour of the size's memory, ``storage_gib_month`` per stored
    GiB-month); defaults in :data:`sbx.control.accounts.pricing.DEFAULT_PRICING`."""
    default_plan: str = "trial"
    """The plan a new account gets when none is given (the installation's first account has ``unlimited``)."""
    rate_limit: float = 20.0
    """Requests per second an account's API key may make on average (token bucket; 0 = no limit); over it, ``429
    rate_limited`` with ``Retry-After``. The installation's admin key is not limited."""
    rate_burst: int = 200
    """Requests an account's key may make at once before :attr:`rate_limit` applies."""
    auth_fail_limit: int = 20
    """Wrong API keys one client address may present in :attr:`auth_fail_window` seconds; after that every key it
    presents is answered ``401 auth_throttled`` (with ``Retry-After``) until the window has passed."""
    auth_fail_window: float = 60.0
    templates: bool = True
    """Memory templates (issue 13, :mod:`sbx.node.memory.templates`): ``sbx new`` restores a checkpointed base sandbox
    of
    its size instead of cold booting, once that size's template is built (in the background, after the first cold
    boot of the size). ``SBX_TEMPLATES=0`` turns them off (every ``new`` cold boots)."""
    warm_pool: int = 2
    """Warm sandboxes (issue 13, :mod:`sbx.node.memory.warmpool`) each node keeps per size whose template is built:
    sandboxes already restored from the template, which the next ``sbx new`` of that size takes over (~0.1 s
    instead of the ~0.4 s restore). Two, so that creates in quick succession (a client making a few at once)
    find one while the node makes the next. ``SBX_WARM_POOL=0`` turns them off."""
    node_url: str = ""
    """Several nodes (issue 10): the URL of a node agent (``sbx node serve``), e.g. ``http://10.0.0.2:7700``. Set,
    ``sbx server`` runs no sandboxes itself and sends every node call there (:mod:`sbx.node.remote`); empty (the
    default): the server runs its own embedded node."""
    node_token: str = ""
    """The node token both sides share: a node agent accepts only requests that carry it, and a server sends it.
    Empty on a node agent: it makes one in ``state_dir/node-token`` and prints where."""
    node_tls_dir: Path | None = None
    """Mutual TLS between servers and node agents (:mod:`sbx.tls`): the folder with ``ca.crt`` (the installation
    CA), ``cert.pem`` and ``key.pem`` (this process's certificate) and, on the host that issues certificates,
    ``ca.key``. Unset: ``state_dir/tls``. A node agent that finds the three files serves HTTPS that demands a
    client certificate of the CA; a server that finds them reaches ``https://`` nodes with its certificate and
    refuses ``http://`` ones that are not on loopback."""
    node_host: str = "127.0.0.1"
    """Where ``sbx node serve`` listens (its address on the network between servers and nodes)."""
    node_port: int = 7700
    node_heartbeat_seconds: float = 2.0
    """Seconds between two heartbeats a server sends its node (capacity, load, fingerprint;
    :mod:`sbx.control.cluster.registry`)."""
    node_unreachable_seconds: float = 6.0
    """A node whose last answered heartbeat is older than this is ``unreachable`` (its sandboxes show
    ``nodeStatus: "unreachable"``, their ``state`` unchanged)."""
    replicate_seconds: float = 10.0
    """Seal replicas (:mod:`sbx.control.cluster.replicas`): seconds between two passes of the loop that copies each
    stopped
    sandbox's disk and memory image to a second node, so it can resume there when its own node is gone (also
    right after each stop). 0 = off."""
    seal_store_seconds: float = 5.0
    """Seconds between two passes of the loop that uploads each stopped sandbox's new seal to ``seal_store`` (and
    retries a failed upload); 0 = off."""
    seal_store_lost_seconds: float = 60.0
    """With a seal store: seconds a node stays unreachable before each running sandbox on it comes back on another
    node from its newest stored seal (:mod:`sbx.control.cluster.rescue`)."""
    metrics_token: str = ""
    """When set, ``GET /metrics`` (server and node agent) answers only ``Authorization: Bearer <it>``; empty (the
    default): it answers anyone who reaches the port (its series are aggregates: :mod:`sbx.metrics`)."""
    log_format: str = "text"
    """``text`` (the default) or ``json``: one JSON object per log line (:mod:`sbx.logs`)."""
    drain_parallel: int = 2
    """Sandboxes a drain (``sbx node drain``, consolidation: :mod:`sbx.control.cluster.drain`) moves at once."""
    consolidate_seconds: float = 300.0
    """Consolidation (issue 11, :mod:`sbx.control.cluster.packing`): seconds between two passes of the loop that
    empties a
    lightly used node onto fuller ones (live migration for running sandboxes) and reports it removable. 0 = off."""
    consolidate_light_fraction: float = 0.25
    """A node is light (a candidate to empty) while the memory its sandboxes that are not stopped hold is below this
    share of the memory it may promise."""
    consolidate_headroom: float = 0.2
    """Share of its promisable memory each destination of a consolidation (and the ready nodes together) keeps
    free after the moves."""
    consolidate_max_moves: int = 20
    """A node holding more sandboxes than this is not emptied by consolidation (it bounds one pass's work)."""
    stats_sample_seconds: float = 5.0
    """Seconds between two stats samples of each running sandbox, kept for the last hour for the console's graphs
    (``GET /v1/sandboxes/{id}/stats``, :mod:`sbx.control.sandboxes.sampler`). 0 = no sampling."""
    sandbox_dns_rate: float = 50.0
    """DNS queries per second each sandbox (each source address on the bridge) may send the node's resolver
    (:mod:`sbx.node.network.resolver`) on average; over it, queries are dropped (no answer) and the server logs it.
    Must be above 0."""
    sandbox_dns_burst: int = 200
    """DNS queries a sandbox may send at once before :attr:`sandbox_dns_rate` applies (its token bucket's size); 1
    or more."""
    dns_upstreams: str = ""
    """Where the node's resolver forwards sandboxes' queries: comma-separated ``IPv4[:port]``
    (``"192.0.2.53,127.0.0.1:5353"``), tried in order. Empty (the default): the nameservers of the host's
    ``/etc/resolv.conf``, loopback ones included, read again when the file changes. A bad item stops the server at
    start."""
    sandbox_max_connections: int = 4096
    """Connections (conntrack entries: TCP, UDP flows, ICMP) one sandbox may hold at once through or towards the
    node (nftables ``ct count`` per source address, :func:`sbx.node.network.ruleset.inet_ruleset`); more are refused
    (TCP reset, ICMP error) until some end, so one sandbox can't fill the host's conntrack table
    (``net.netfilter.nf_conntrack_max``). 0 = no limit."""
    sandbox_connection_rate: int = 200
    """New connections per second one sandbox may start through or towards the node (bursts of twice that); more
    are refused like those over :attr:`sandbox_max_connections`. It bounds what closing connections fast leaves in
    the conntrack table (a closed TCP connection stays there ~120 s in ``TIME_WAIT`` without counting as open):
    about this x 120 entries per sandbox. 0 = no limit."""
    sizes: dict[str, Size] = field(default_factory=lambda: dict(PRODUCTION_SIZES))

    @property
    def volume(self) -> Path:
        return self.home / "volume"

    @property
    def volume_backing(self) -> Path:
        return self.home / "volume.xfs"

    @property
    def criu_dir(self) -> Path:
        return self.home / "criu"

    @property
    def volumes_dir(self) -> Path:
        """Persistent volumes (issue 34): ``meta/<id>.db`` (JuiceFS metadata), ``store/`` (their data when no S3
        bucket is set), ``logs/``; root-only."""
        return self.home / "volumes"

    @property
    def images_dir(self) -> Path:
        return self.volume / "images"

    @property
    def tls_dir(self) -> Path:
        """``node_tls_dir`` when set, else ``state_dir/tls`` (:mod:`sbx.tls`)."""
        return self.node_tls_dir or self.state_dir / "tls"

    @property
    def node_dir(self) -> Path:
        return self.volume / "nodes" / self.node_name

    @property
    def db_url(self) -> str:
        """``database_url`` when set, else the SQLite file ``state_dir/sbx.db``."""
        return self.database_url or f"sqlite:///{self.state_dir / 'sbx.db'}"

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def size(self, name: str) -> Size:
        """The :class:`Size` called ``name``; raises ``KeyError`` for an unknown type."""
        return self.sizes[name]


def _flag(value: str) -> bool:
    """An on/off environment setting: ``0``, ``false``, ``no``, ``off`` (any case) are off, the rest on."""
    return value.strip().lower() not in ("0", "false", "no", "off")


_ENV_FIELDS: dict[str, tuple[str, Callable[[str], object]]] = {
    "SBX_HOME": ("home", Path),
    "SBX_S3_ENDPOINT": ("s3_endpoint", str),
    "SBX_S3_BUCKET": ("s3_bucket", str),
    "SBX_S3_ACCESS_KEY": ("s3_access_key", str),
    "SBX_S3_SECRET_KEY": ("s3_secret_key", str),
    "SBX_S3_REGION": ("s3_region", str),
    "SBX_SEAL_STORE": ("seal_store", str),
    "SBX_SEAL_STORE_SECONDS": ("seal_store_seconds", float),
    "SBX_SEAL_STORE_LOST_SECONDS": ("seal_store_lost_seconds", float),
    "SBX_NODE_NAME": ("node_name", str),
    "SBX_STATE_DIR": ("state_dir", Path),
    "SBX_BRIDGE": ("bridge", str),
    "SBX_SUBNET": ("subnet", str),
    "SBX_EGRESS_ALLOW": ("egress_allow", str),
    "SBX_DATABASE_URL": ("database_url", str),
    "SBX_DEFAULT_RUNTIME": ("default_runtime", str),
    "SBX_DOMAIN": ("domain", str),
    "SBX_HOST": ("host", str),
    "SBX_PORT": ("port", int),
    "SBX_PROXY_PORT": ("proxy_port", int),
    "SBX_SSH_GATEWAY_PORT": ("ssh_gateway_port", int),
    "SBX_EGRESS_PROXY_PORT": ("egress_proxy_port", int),
    "SBX_EGRESS_UPSTREAM_CA": ("egress_upstream_ca", str),
    "SBX_BUILD_CA_FILE": ("build_ca_file", str),
    "SBX_PROFILE": ("profile", str),
    "SBX_AUTO_SNAPSHOT_SECONDS": ("auto_snapshot_seconds", int),
    "SBX_AUTO_SNAPSHOT_KEEP": ("auto_snapshot_keep", int),
    "SBX_REQUIRE_MEMORY_WAIT": ("require_memory_wait", float),
    "SBX_MAX_BODY_BYTES": ("max_body_bytes", int),
    "SBX_EXEC_CHANNEL": ("exec_channel", _flag),
    "SBX_MEMORY_RESERVE_MIB": ("memory_reserve_mib", int),
    "SBX_MEMORY_OVERCOMMIT": ("memory_overcommit", float),
    "SBX_DISK_RESERVE_GIB": ("disk_reserve_gib", float),
    "SBX_DISK_FLOOR_GIB": ("disk_floor_gib", float),
    "SBX_DISK_CHECK_SECONDS": ("disk_check_seconds", float),
    "SBX_VOLUME_SIZE_GIB": ("volume_size_gib", int),
    "SBX_TEMPLATES": ("templates", _flag),
    "SBX_WARM_POOL": ("warm_pool", int),
    "SBX_TRIM_SECONDS": ("trim_seconds", int),
    "SBX_DEFAULT_PLAN": ("default_plan", str),
    "SBX_RATE_LIMIT": ("rate_limit", float),
    "SBX_RATE_BURST": ("rate_burst", int),
    "SBX_AUTH_FAIL_LIMIT": ("auth_fail_limit", int),
    "SBX_AUTH_FAIL_WINDOW": ("auth_fail_window", float),
    "SBX_NODE_URL": ("node_url", str),
    "SBX_NODE_TOKEN": ("node_token", str),
    "SBX_NODE_HOST": ("node_host", str),
    "SBX_NODE_TLS_DIR": ("node_tls_dir", Path),
    "SBX_NODE_PORT": ("node_port", int),
    "SBX_NODE_HEARTBEAT_SECONDS": ("node_heartbeat_seconds", float),
    "SBX_NODE_UNREACHABLE_SECONDS": ("node_unreachable_seconds", float),
    "SBX_STATS_SAMPLE_SECONDS": ("stats_sample_seconds", float),
    "SBX_DRAIN_PARALLEL": ("drain_parallel", int),
    "SBX_METRICS_TOKEN": ("metrics_token", str),
    "SBX_LOG_FORMAT": ("log_format", str),
    "SBX_CONSOLIDATE_SECONDS": ("consolidate_seconds", float),
    "SBX_REPLICATE_SECONDS": ("replicate_seconds", float),
    "SBX_CONSOLIDATE_LIGHT_FRACTION": ("consolidate_light_fraction", float),
    "SBX_CONSOLIDATE_HEADROOM": ("consolidate_headroom", float),
    "SBX_CONSOLIDATE_MAX_MOVES": ("consolidate_max_moves", int),
    "SBX_SANDBOX_DNS_RATE": ("sandbox_dns_rate", float),
    "SBX_SANDBOX_DNS_BURST": ("sandbox_dns_burst", int),
    "SBX_DNS_UPSTREAMS": ("dns_upstreams", str),
    "SBX_SANDBOX_MAX_CONNECTIONS": ("sandbox_max_connections", int),
    "SBX_SANDBOX_CONNECTION_RATE": ("sandbox_connection_rate", int),
}


def load_settings(**overrides: object) -> Settings:
    """Build :class:`Settings` from defaults, the TOML file at ``$SBX_CONFIG`` (if it exists), ``SBX_*``
    environment variables, then ``overrides`` (keyword arguments named like the fields)."""
    values: dict[str, object] = {}
    cfg = Path(os.environ.get("SBX_CONFIG", "/etc/sbx/server.toml"))
    if cfg.is_file():
        with cfg.open("rb") as f:
            data = tomllib.load(f)
        for key, value in data.items():
            if key in Settings.__dataclass_fields__ and key != "sizes":
                if key in ("home", "state_dir", "node_tls_dir"):
                    value = Path(value)
                elif key in ("egress_allow", "dns_upstreams") and isinstance(value, list):  # TOML may list them
                    value = ",".join(str(v) for v in value)
                values[key] = value
    for env, (name, kind) in _ENV_FIELDS.items():
        if env in os.environ:
            try:
                values[name] = kind(os.environ[env])
            except ValueError:
                kind_name = getattr(kind, "__name__", "value")
                raise ValueError(f"{env}={os.environ[env]!r} is not a valid {kind_name}") from None
    values.update(overrides)
    settings = Settings(**values)  # type: ignore[arg-type]
    if settings.default_runtime not in RUNTIME_CLASSES:
        raise ValueError(f"default_runtime (SBX_DEFAULT_RUNTIME) {settings.default_runtime!r} is not one of "
                         f"{', '.join(RUNTIME_CLASSES)}")
    store = settings.seal_store
    if store and not (re.fullmatch(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?", store) or store.startswith("/")
                      or store.startswith("file:///")):
        raise ValueError(f"seal_store (SBX_SEAL_STORE) {store!r} is neither s3://BUCKET[/PREFIX] nor an absolute "
                         "directory")
    if settings.profile == "test":
        settings = replace(settings, sizes=dict(TEST_SIZES))
    return settings
