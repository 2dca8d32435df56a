"""Generated protobuf and gRPC stubs for protos/polar/v1 (scripts/gen_protos.py). Do not edit."""
