"""A small synchronous Python client for the prefix_service gRPC API (used by the CLI).

    with PrefixServiceClient("127.0.0.1:50051") as client:
        for msg in client.generate("Question: ...", template="table_qa", max_tokens=64):
            print(msg.text, end="", flush=True)

A server with TLS: PrefixServiceClient("host:50051", tls_ca_file="ca.pem") (or tls=True when its
certificate chains to a root the system trusts).
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Iterator, Mapping

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


def structured_output_message(value: pb.StructuredOutput | Mapping[str, Any]) -> pb.StructuredOutput:
    """A pb.StructuredOutput from itself or from a one-entry mapping of its kind to its value
    ({"choice": ["yes", "no"]}, {"json_schema": {...}}, ...); ValueError naming what is wrong."""
    if isinstance(value, pb.StructuredOutput):
        return value
    kinds = [f.name for f in pb.StructuredOutput.DESCRIPTOR.oneofs_by_name["kind"].fields]
    if not isinstance(value, Mapping) or len(value) != 1 or next(iter(value)) not in kinds:
        raise ValueError(f"structured_output: expected one of {', '.join(kinds)} as the only key, got {value!r}")
    (kind, spec), = value.items()
    if kind == "choice":
        if isinstance(spec, str):
            raise ValueError("structured_output: choice takes a list of strings, not one string")
        return pb.StructuredOutput(choice=pb.Choices(choices=list(spec)))
    if kind == "json_schema" and not isinstance(spec, str):
        spec = json.dumps(spec)
    return pb.StructuredOutput(**{kind: spec})


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
                 structured_output: pb.StructuredOutput | Mapping[str, Any] | None = None,
                 timeout: float | None = None) -> Iterator[pb.GenerateResponse]:
        """Stream the responses; the last one has finish_reason and usage. Raises grpc.RpcError.
        Closing the iterator early cancels the call (the server frees the request's blocks).

        structured_output: what the output must be (unset: the template's default output, if it has
        one), a pb.StructuredOutput or one of {"choice": [...]}, {"json_schema": schema (a dict or its
        JSON text)}, {"regex": "..."}, {"grammar": "..."}, {"json_object": True}, {"text": True}."""
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                     stop=list(stop), ignore_eos=ignore_eos)
        if seed is not None:
            sampling.seed = seed
        if structured_output is not None:
            sampling.structured_output.CopyFrom(structured_output_message(structured_output))
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
