"""TLS for the MQTT tests: a CA and a server certificate for 127.0.0.1 made with `cryptography`, a mosquitto
TLS listener's settings, and a TCP relay to a broker that can drop its connections with a reset (what a
broker that crashes, or a network that fails, does to its clients)."""

from __future__ import annotations

import datetime
import getpass
import ipaddress
import select
import socket
import struct
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name | None,
                 issuer_key: ec.EllipticCurvePrivateKey, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False),
            critical=True).add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    else:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_ca(folder: Path, name: str) -> tuple[Path, ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA: its certificate's PEM file `<folder>/<name>.pem`, its key, its certificate."""
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = _certificate(name, key, None, key, ca=True)
    path = folder / f"{name}.pem"
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return path, key, certificate


def make_server_certificate(folder: Path, ca_key: ec.EllipticCurvePrivateKey,
                            ca_certificate: x509.Certificate) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by the CA: (certificate file, key file) in `folder`."""
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = _certificate("127.0.0.1", key, ca_certificate.subject, ca_key, ca=False)
    cert_file, key_file = folder / "server.pem", folder / "server.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(_key_pem(key))
    return cert_file, key_file


def tls_broker_settings(folder: Path, port: int) -> tuple[str, Path]:
    """A mosquitto with only a TLS listener on 127.0.0.1:`port` (anonymous), its certificate signed by a CA
    made here: (its settings, the CA's PEM file)."""
    ca_file, ca_key, ca_certificate = make_ca(folder, "test-ca")
    cert_file, key_file = make_server_certificate(folder, ca_key, ca_certificate)
    # as root, mosquitto drops to the user 'mosquitto', who cannot read the test's private folder
    return (f"user {getpass.getuser()}\npersistence false\nallow_anonymous true\nlistener {port} 127.0.0.1\n"
            f"certfile {cert_file}\nkeyfile {key_file}\n"), ca_file


class _Listener:
    """Listens on 127.0.0.1:`port` from a thread of its own, each connection handed to `_serve(client)` until
    `_stop()`; `target` is the broker's port at 127.0.0.1. A subclass sets its own attributes before this starts."""

    def __init__(self, port: int, target: int):
        self.target = target
        self.server = socket.create_server(("127.0.0.1", port))
        self.stopping = threading.Event()
        self.acceptor = threading.Thread(target=self._accept, daemon=True)
        self.acceptor.start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            if not select.select([self.server], [], [], 0.05)[0]:
                continue
            client, _ = self.server.accept()
            self._serve(client)

    def _serve(self, client: socket.socket) -> None:
        raise NotImplementedError

    def _stop(self, *threads: threading.Thread) -> None:
        self.stopping.set()
        for thread in [self.acceptor, *threads]:
            thread.join(5)
        self.server.close()


class ResettingRelay(_Listener):
    """Relays TCP connections from 127.0.0.1:`port` to the broker at 127.0.0.1:`target`; `reset()` drops
    them all with a TCP reset (SO_LINGER 0) and stops listening, as a crashed broker's host would."""

    def __init__(self, port: int, target: int):
        self.clients: list[socket.socket] = []
        self.pipes: list[threading.Thread] = []
        self.upstreams: list[socket.socket] = []
        super().__init__(port, target)

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target))
        self.clients.append(client)
        self.upstreams.append(upstream)
        for source, sink in ((client, upstream), (upstream, client)):
            pipe = threading.Thread(target=self._pipe, args=(source, sink), daemon=True)
            pipe.start()
            self.pipes.append(pipe)

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        """Never blocked in recv when reset() closes the sockets (a socket closed under a blocked call is
        released, and its reset sent, only when the call returns)."""
        try:
            while not self.stopping.is_set():
                if select.select([source], [], [], 0.05)[0]:
                    data = source.recv(65536)
                    if not data:
                        break
                    sink.sendall(data)
        except OSError:
            pass

    def reset(self) -> None:
        self._stop(*self.pipes)
        for client in self.clients:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
        for upstream in self.upstreams:
            upstream.close()


class HandshakeResetter(_Listener):
    """Listens on 127.0.0.1:`port`; each connection's first bytes (the client's MQTT CONNECT) go to the broker at
    127.0.0.1:`target`, and the client's connection is then dropped with a TCP reset before the broker's CONNACK
    can reach it: a reset during the MQTT handshake, every time. `connects` counts them."""

    def __init__(self, port: int, target: int, *, after_connack: bool = False):
        self.after_connack = after_connack
        self.connects = 0
        super().__init__(port, target)

    def _serve(self, client: socket.socket) -> None:
        with client, socket.create_connection(("127.0.0.1", self.target)) as upstream:
            connect = client.recv(65536)
            upstream.sendall(connect)
            self.connects += 1
            if self.after_connack:
                client.sendall(upstream.recv(4))
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def close(self) -> None:
        self._stop()
