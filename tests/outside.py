"""A fake outside world for tests and the benchmark: a network namespace on this host reached through a veth pair
and host routes, so traffic from a sandbox to it crosses the host's forward path (nftables, the egress proxy)
exactly as traffic to a real remote service would.

- :func:`outside_netns`: the namespace, the veth pair, one ``/32`` per target address on the namespace's ``lo``
  with a host route to it, and the processes that serve them (started inside with ``ip netns exec``); all of it
  is removed on exit, a crashed run's leftovers on entry.
- :func:`make_ca`: a throwaway CA and one server certificate per host name, for TLS servers in that namespace.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def outside_netns(tag: str, link: str, targets: Sequence[str], servers: Sequence[Sequence[str]] = (),
                  ready_line: bool = False) -> Iterator[str]:
    """Namespace ``<tag>ns`` joined to the host by veth ``<tag>h`` (host) / ``<tag>p`` (namespace) on ``link``
    (a small IPv4 network: the host takes its first address, the namespace its second), holding ``targets``
    (addresses the host routes into it). Each argv of ``servers`` runs inside it; with ``ready_line`` each must
    print ``ready`` on its first line of stdout before the next starts (``RuntimeError`` otherwise). Yields the
    host's address on the link. Names: ``tag`` is at most 12 bytes (interface names stop at 15)."""
    net = ipaddress.IPv4Network(link)
    ns, host_if, ns_if = f"{tag}ns", f"{tag}h", f"{tag}p"
    host_ip, ns_ip = str(net.network_address + 1), str(net.network_address + 2)

    def clean() -> None:
        for t in targets:
            subprocess.run(["ip", "route", "del", f"{t}/32"], capture_output=True)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    clean()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{host_ip}/{net.prefixlen}", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{ns_ip}/{net.prefixlen}", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        for t in targets:
            _ip("-n", ns, "addr", "add", f"{t}/32", "dev", "lo")
            _ip("route", "add", f"{t}/32", "via", ns_ip, "dev", host_if)
        _ip("-n", ns, "route", "add", "default", "via", host_ip)
        for argv in servers:
            proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv],
                                    stdout=subprocess.PIPE if ready_line else subprocess.DEVNULL,
                                    stderr=subprocess.STDOUT if ready_line else subprocess.DEVNULL)
            procs.append(proc)
            if ready_line:
                assert proc.stdout is not None
                line = proc.stdout.readline()
                if line.strip() != b"ready":
                    raise RuntimeError(f"{argv[-1] if argv else '?'} did not start: {line + proc.stdout.read(4000)!r}")
        yield host_ip
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        clean()


def make_ca(folder: Path, common_name: str, hosts: dict[str, str], days: int = 30) -> Path:
    """A CA (``folder/ca.crt``) and, for each ``name: host`` of ``hosts``, a server certificate for ``host``
    signed by it (``folder/<name>.crt`` and ``<name>.key``, PEM, P-256), valid from yesterday for ``days``
    days. Returns the CA file."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)
    start, end = now - dt.timedelta(days=1), now + dt.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (folder / "ca.crt").write_bytes(ca.public_bytes(pem))
    for name, host in hosts.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False)
                .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        (folder / f"{name}.crt").write_bytes(cert.public_bytes(pem))
        (folder / f"{name}.key").write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))
    return folder / "ca.crt"
