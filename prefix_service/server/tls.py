"""TLS for every address the server listens on (generation, admin, metrics): the PEM certificate
chain and key of server.tls_cert_file / server.tls_key_file, read and checked as a pair at start
so that a wrong file stops the start with its name instead of failing each client's handshake."""
from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc

from prefix_service.config import ServerConfig
from prefix_service.errors import ConfigError


@dataclass(frozen=True)
class TlsFiles:
    cert_file: str
    key_file: str
    cert_pem: bytes
    key_pem: bytes

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])


def load_tls(config: ServerConfig) -> TlsFiles | None:
    """None when TLS is not configured. Raises ConfigError naming the file that is wrong."""
    cert_file, key_file = config.tls_cert_file, config.tls_key_file
    if cert_file is None or key_file is None:  # TLS is off (the config gives both or neither)
        return None
    pems = {}
    for key, path in (("tls_cert_file", cert_file), ("tls_key_file", key_file)):
        try:
            with open(path, "rb") as f:
                pems[key] = f.read()
        except OSError as e:
            raise ConfigError(f"server.{key}: cannot read {path}: {e.strerror or e}") from None
    try:
        # an encrypted key gets an empty password (and fails) instead of a prompt on the terminal
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert_file, key_file, password=lambda: b"")
    except (ssl.SSLError, ValueError) as e:
        raise ConfigError(f"server.tls_cert_file / server.tls_key_file: {cert_file} and "
                          f"{key_file} are not a PEM certificate chain and its private key ({e})") from None
    return TlsFiles(cert_file, key_file, pems["tls_cert_file"], pems["tls_key_file"])
