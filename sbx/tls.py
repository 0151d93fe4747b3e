"""Mutual TLS between servers and node agents (issue 35): the installation CA, the certificates it issues, and the
``ssl`` contexts both sides use.

A TLS folder (``Settings.tls_dir``: ``SBX_NODE_TLS_DIR``, else ``<state_dir>/tls``) holds:

- ``ca.crt``: the certificates a peer must chain to (the installation CA; during a CA roll, the new one and the
  old one, concatenated);
- ``cert.pem`` and ``key.pem`` (0600): this process's certificate and key (a node's, or a server's);
- ``ca.key`` (0600), only on the host that issues certificates (``sbx ca ...``), with ``ca-cert.pem``: the CA's
  own certificate, the one new certificates are signed under.

Every certificate the CA issues is good for both ends of a TLS connection (``serverAuth`` and ``clientAuth``): a
node agent serves the servers and reaches other nodes (a live migration's transfer and page stream); a server is a
client only, but one shape keeps rotation simple. A node's certificate names its addresses and host names (the
subject alternative names a client checks against the node's URL).

Nothing here imports another sbx module: servers, nodes and the runtime's page server all use it.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
"""Days an installation CA is valid."""
CERT_DAYS = 825
"""Days a node's or server's certificate is valid."""

CA_CERT, CA_KEY, CA_OWN = "ca.crt", "ca.key", "ca-cert.pem"
CERT, KEY = "cert.pem", "key.pem"


class TLSError(Exception):
    """A TLS folder is missing a file, or a file is not what it should be (the message says which)."""


@dataclass(frozen=True)
class Identity:
    """The files a process proves itself and checks its peers with: ``ca`` (trusted CAs, PEM), ``cert`` and
    ``key`` (its own certificate and key, PEM)."""

    ca: Path
    cert: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        """A server-side context that demands a client certificate chaining to :attr:`ca` (``CERT_REQUIRED``),
        TLS 1.2 at least."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(cafile=str(self.ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """A client-side context that presents :attr:`cert` and checks the server's certificate against
        :attr:`ca` and the host name or address it is reached at."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(cafile=str(self.ca))
        return ctx


def identity(folder: Path) -> Identity | None:
    """The identity in TLS folder ``folder`` when ``ca.crt``, ``cert.pem`` and ``key.pem`` all exist there, else
    None (TLS is off for this process)."""
    files = Identity(folder / CA_CERT, folder / CERT, folder / KEY)
    return files if all(p.is_file() for p in (files.ca, files.cert, files.key)) else None


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` atomically with ``mode`` (a temporary file renamed over it)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "sbx"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(folder: Path, name: str = "sbx installation CA") -> x509.Certificate:
    """Make a new CA in ``folder``: ``ca.key`` (0600, P-256) and ``ca-cert.pem``; ``ca.crt`` (what peers trust) is
    set to it when it does not exist yet (:func:`trust` changes it during a roll). Overwrites an existing
    ``ca.key``/``ca-cert.pem``: callers check :func:`has_ca` first. Returns the CA certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    subject = _name(f"{name} {now:%Y-%m-%d %H%M%S}")
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    _write(folder / CA_KEY, _key_pem(key), 0o600)
    _write(folder / CA_OWN, pem, 0o644)
    if not (folder / CA_CERT).is_file():
        _write(folder / CA_CERT, pem, 0o644)
    return cert


def has_ca(folder: Path) -> bool:
    """Whether ``folder`` holds a CA that can issue (``ca.key`` and ``ca-cert.pem``)."""
    return (folder / CA_KEY).is_file() and (folder / CA_OWN).is_file()


def _load_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    if not has_ca(folder):
        raise TLSError(f"no installation CA in {folder} (run `sbx ca init` on the server)")
    cert = x509.load_pem_x509_certificate((folder / CA_OWN).read_bytes())
    key = serialization.load_pem_private_key((folder / CA_KEY).read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TLSError(f"{folder / CA_KEY} is not an EC key")
    return cert, key


def issue(ca_folder: Path, out: Path, name: str, hosts: list[str] | tuple[str, ...] = ()) -> x509.Certificate:
    """Issue a certificate for ``name`` (its common name) under the CA in ``ca_folder`` and write a complete TLS
    folder at ``out``: ``cert.pem``, ``key.pem`` (0600, a fresh P-256 key) and ``ca.crt`` (a copy of the CA
    folder's). ``hosts``: the IP addresses and DNS names it is reached at (subject alternative names; a client
    checks the node's URL against them). Good for ``serverAuth`` and ``clientAuth``, :data:`CERT_DAYS` days.
    Raises :class:`TLSError` (no CA in ``ca_folder``), ``ValueError`` (an empty or bad name)."""
    if not name.strip() or any(c in name for c in "\n\r/"):
        raise ValueError(f"bad certificate name {name!r}")
    ca_cert, ca_key = _load_ca(ca_folder)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    sans: list[x509.GeneralName] = []
    for h in dict.fromkeys(h.strip() for h in hosts if h.strip()):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    builder = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=CERT_DAYS))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write(out / KEY, _key_pem(key), 0o600)
    _write(out / CERT, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    if out.resolve() != ca_folder.resolve():
        _write(out / CA_CERT, (ca_folder / CA_CERT).read_bytes(), 0o644)
    return cert


def rotate_ca(folder: Path) -> x509.Certificate:
    """Start a CA roll in ``folder``: the current CA is kept as ``ca-old.key``/``ca-old-cert.pem``, a new one is
    made, and ``ca.crt`` trusts both (so certificates of either verify while new ones are handed out). Raises
    :class:`TLSError` when ``folder`` has no CA."""
    old_cert, _ = _load_ca(folder)
    os.replace(folder / CA_KEY, folder / "ca-old.key")
    os.replace(folder / CA_OWN, folder / "ca-old-cert.pem")
    new = make_ca(folder)
    _write(folder / CA_CERT, new.public_bytes(serialization.Encoding.PEM)
           + old_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return new


def finish_rotation(folder: Path) -> None:
    """End a CA roll in ``folder``: ``ca.crt`` trusts the new CA only and the old CA's files are removed (every
    node and server must hold a certificate of the new CA by then). Raises :class:`TLSError` without a CA."""
    new, _ = _load_ca(folder)
    _write(folder / CA_CERT, new.public_bytes(serialization.Encoding.PEM), 0o644)
    for stale in ("ca-old.key", "ca-old-cert.pem"):
        (folder / stale).unlink(missing_ok=True)


def describe(path: Path) -> list[dict[str, str]]:
    """The certificates in PEM file ``path``: ``[{"subject", "issuer", "serial", "notAfter", "hosts"}]``
    (``notAfter`` ISO 8601 UTC; ``hosts`` comma-separated). Raises ``OSError``, ``ValueError`` (not PEM)."""
    items = []
    for cert in x509.load_pem_x509_certificates(path.read_bytes()):
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            hosts = [str(v) for v in san.get_values_for_type(x509.IPAddress)] + san.get_values_for_type(x509.DNSName)
        except x509.ExtensionNotFound:
            hosts = []
        items.append({"subject": cert.subject.rfc4514_string(), "issuer": cert.issuer.rfc4514_string(),
                      "serial": format(cert.serial_number, "x"),
                      "notAfter": cert.not_valid_after_utc.isoformat(), "hosts": ",".join(hosts)})
    return items
