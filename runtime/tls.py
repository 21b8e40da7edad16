"""Mutual TLS for links between processes, and a throwaway certificate authority for local
clusters.

The link handshake (auth.py) proves each end holds the cluster token, but after it the frames
travel in the clear: anyone on the path could read trajectories and weights or inject frames.
With TLS every connection of a link (websocket and frame stream) is encrypted and both ends
present a certificate signed by the cluster's CA, so the token handshake then runs inside an
authenticated channel.

A directory holds the three files a process needs (`ca.pem`, `cert.pem`, `key.pem`); every
process reads it from `$SHOAL_TLS_DIR` by default, so the tasks a node daemon starts inherit it
as they inherit the token. `local_ca.make_local_ca` writes such a directory for a local
cluster; on real hosts an operator's own CA issues one certificate per host, with the host's addresses as
subject alternative names.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shoal.errors import ConfigError

TLS_DIR_ENV = "SHOAL_TLS_DIR"
ALLOW_CLEARTEXT_ENV = "SHOAL_ALLOW_CLEARTEXT"
CA_FILE = "ca.pem"
CERT_FILE = "cert.pem"
KEY_FILE = "key.pem"


@dataclass(frozen=True)
class TlsFiles:
    """Where one process finds its CA, its certificate and its private key."""

    directory: Path

    def __post_init__(self) -> None:
        for name in (CA_FILE, CERT_FILE, KEY_FILE):
            if not (self.directory / name).is_file():
                raise ConfigError(
                    f"TLS directory {self.directory} has no {name}; it needs {CA_FILE}, "
                    f"{CERT_FILE} and {KEY_FILE} (`shoal up --tls` makes one for a local cluster)"
                )

    def server_context(self, mutual: bool = True) -> ssl.SSLContext:
        """Mutual: accepts only clients whose certificate the cluster CA signed (links). Not
        mutual: any client, which then authenticates otherwise (the admin API's bearer token,
        so operators' tools need no certificate)."""
        context = self._context(ssl.Purpose.CLIENT_AUTH)
        context.verify_mode = ssl.CERT_REQUIRED if mutual else ssl.CERT_NONE
        return context

    def client_context(self) -> ssl.SSLContext:
        """Checks the server's certificate and host name, and presents this process's own."""
        return self._context(ssl.Purpose.SERVER_AUTH)

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(purpose, cafile=self._path(CA_FILE))
            context.load_cert_chain(self._path(CERT_FILE), self._path(KEY_FILE))
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"cannot load the CA, certificate and key in {self.directory}: {exc}"
            ) from None
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        return context

    def _path(self, name: str) -> str:
        return str(self.directory / name)


def tls_from_env(environ: Mapping[str, str] | None = None) -> TlsFiles | None:
    """The TLS directory named by `$SHOAL_TLS_DIR`, or None (cleartext) when unset."""
    value = (os.environ if environ is None else environ).get(TLS_DIR_ENV)
    return TlsFiles(Path(value)) if value else None


def cleartext_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `$SHOAL_ALLOW_CLEARTEXT` lets this process serve cleartext off loopback."""
    value = (os.environ if environ is None else environ).get(ALLOW_CLEARTEXT_ENV, "")
    return value.strip().lower() in ("1", "true", "yes")


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address or `localhost`; any other name counts as off
    loopback (nothing is resolved: the answer must not depend on DNS)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_cleartext(what: str, host: str, tls: TlsFiles | None, allowed: bool) -> None:
    """TLS is off by default on loopback and on by default off it: refuse to serve cleartext
    on another address unless the operator said the network is trusted."""
    if tls is None and not allowed and not is_loopback(host):
        raise ConfigError(
            f"{what} {host} is off loopback and would serve cleartext: set ${TLS_DIR_ENV} to a "
            f"TLS directory (docs/security.md), or set {ALLOW_CLEARTEXT_ENV}=1 on a network "
            "you trust"
        )
