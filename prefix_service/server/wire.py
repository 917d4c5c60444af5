"""Register the servicers with request decoders that never raise.

The generated `add_*Servicer_to_server` functions hand grpc the message's `FromString`; when a
client sends bytes that do not parse (a stale or foreign proto, invalid UTF-8 in a string field),
grpc ends the call with UNKNOWN. Here such a request reaches the servicer as an `Undecodable`,
and `check_decoded` turns it into INVALID_ARGUMENT with a message saying what to fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import grpc

from prefix_service.errors import InvalidRequest
from prefix_service.proto import prefix_service_pb2 as pb

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["PrefixAdmin"].full_name


@dataclass(frozen=True)
class Undecodable:
    """A request whose bytes are not a valid message of the method's request type."""
    message_type: str
    error: str


def check_decoded(request: Any) -> None:
    """Raise InvalidRequest for an Undecodable request."""
    if isinstance(request, Undecodable):
        raise InvalidRequest(f"the request is not a valid {request.message_type} ({request.error}); build it "
                             f"with stubs generated from proto/prefix_service.proto")


def _decoder(message_cls: Any) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except Exception as e:  # noqa: BLE001 - any failure to parse is the client's malformed request
            return Undecodable(message_cls.DESCRIPTOR.full_name, str(e) or type(e).__name__)
    return decode


def add_generation(servicer: Any, server: grpc.aio.Server) -> None:
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_decoder(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Score": grpc.unary_unary_rpc_method_handler(
            servicer.Score, request_deserializer=_decoder(pb.ScoreRequest),
            response_serializer=pb.ScoreResponse.SerializeToString),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetServerInfo, request_deserializer=_decoder(pb.GetServerInfoRequest),
            response_serializer=pb.ServerInfo.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GENERATION_SERVICE, handlers),))


def add_admin(servicer: Any, server: grpc.aio.Server) -> None:
    methods: dict[str, tuple[Any, Any]] = {  # name -> (request class, response class)
        "AddPrefixTemplate": (pb.AddPrefixTemplateRequest, pb.PrefixTemplate),
        "RemovePrefixTemplate": (pb.RemovePrefixTemplateRequest, pb.RemovePrefixTemplateResponse),
        "ListPrefixTemplates": (pb.ListPrefixTemplatesRequest, pb.ListPrefixTemplatesResponse),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(getattr(servicer, name), request_deserializer=_decoder(req),
                                                  response_serializer=resp.SerializeToString)
        for name, (req, resp) in methods.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(ADMIN_SERVICE, handlers),))
