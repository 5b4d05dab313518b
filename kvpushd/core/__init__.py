"""Pure logic: no asyncio, grpc, nixl or torch. Time is an argument; actions are return values."""
