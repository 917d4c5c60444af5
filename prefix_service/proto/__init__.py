"""Generated gRPC stubs for proto/prefix_service.proto (package prefix_service.v1).

    from prefix_service.proto import prefix_service_pb2 as pb, prefix_service_pb2_grpc as pb_grpc

Do not edit the *_pb2* files by hand: change the .proto, then run
`python -m prefix_service.proto.regenerate` (with the grpcio-tools version pinned in setup.cfg's
test extra; a test regenerates them and compares).
"""
