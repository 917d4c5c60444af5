"""A small synchronous Python client for the prefix_service gRPC API (used by the CLI).

    with PrefixServiceClient("127.0.0.1:50051") as client:
        for msg in client.generate("Question: ...", template="table_qa", max_tokens=64):
            print(msg.text, end="", flush=True)

A server with TLS: PrefixServiceClient("host:50051", tls_ca_file="ca.pem") (or tls=True when its
certificate chains to a root the system trusts).
"""
from __future__ import annotations

from typing import Iterable, Iterator, Mapping

import grpc

from prefix_service.proto import prefix_service_pb2 as pb
from prefix_service.proto import prefix_service_pb2_grpc as pb_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"


def make_channel(address: str, *, tls: bool = False, tls_ca_file: str | None = None) -> grpc.Channel:
    """A plaintext channel, or TLS when tls is true or a CA file is given (without one the
    system's trusted roots check the server's certificate)."""
    if not tls and tls_ca_file is None:
        return grpc.insecure_channel(address)
    roots = None
    if tls_ca_file is not None:
        with open(tls_ca_file, "rb") as f:
            roots = f.read()
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=roots))


class PrefixServiceClient:
    def __init__(self, address: str = DEFAULT_ADDRESS, token: str | None = None, *, tls: bool = False,
                 tls_ca_file: str | None = None) -> None:
        self.address = address
        self._channel = make_channel(address, tls=tls, tls_ca_file=tls_ca_file)
        self._generation = pb_grpc.GenerationStub(self._channel)
        self._admin = pb_grpc.PrefixAdminStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def generate(self, prompt: str = "", template: str | None = None, *,
                 messages: Iterable[Mapping[str, str]] | None = None, max_tokens: int = 0,
                 temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0, seed: int | None = None,
                 stop: Iterable[str] = (), ignore_eos: bool = False, request_id: str = "",
                 timeout: float | None = None) -> Iterator[pb.GenerateResponse]:
        """Stream the responses; the last one has finish_reason and usage. Raises grpc.RpcError.
        Closing the iterator early cancels the call (the server frees the request's blocks)."""
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                     stop=list(stop), ignore_eos=ignore_eos)
        if seed is not None:
            sampling.seed = seed
        request = pb.GenerateRequest(
            prefix_name=template or "", prompt=prompt, sampling=sampling, request_id=request_id,
            messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in (messages or ())])
        call = self._generation.Generate(request, timeout=timeout)
        try:
            yield from call
        finally:
            call.cancel()  # no-op once finished

    def add_template(self, name: str, content: str | None = None, *, system_prompt: str | None = None,
                     timeout: float | None = None) -> pb.PrefixTemplate:
        request = pb.AddPrefixTemplateRequest(name=name, content=content or "", system_prompt=system_prompt or "")
        return self._admin.AddPrefixTemplate(request, metadata=self._metadata, timeout=timeout)

    def remove_template(self, name: str, timeout: float | None = None) -> pb.RemovePrefixTemplateResponse:
        return self._admin.RemovePrefixTemplate(pb.RemovePrefixTemplateRequest(name=name),
                                                metadata=self._metadata, timeout=timeout)

    def list_templates(self, timeout: float | None = None) -> list[pb.PrefixTemplate]:
        resp = self._admin.ListPrefixTemplates(pb.ListPrefixTemplatesRequest(), metadata=self._metadata,
                                               timeout=timeout)
        return list(resp.templates)

    def server_info(self, timeout: float | None = None) -> pb.ServerInfo:
        """What the server computes with: the model, its context length, each engine's dtype and backend."""
        return self._generation.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PrefixServiceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
