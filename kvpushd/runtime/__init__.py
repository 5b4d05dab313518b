"""The asyncio side of the daemon, one room per owned state (see docs/architecture.md)."""
