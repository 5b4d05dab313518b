"""Thin gRPC servicers: protobuf <-> plain values, and errors -> status codes in one table."""
