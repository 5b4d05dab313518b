"""kvpushd's lab: the local demo, the reference engine, benchmarks, network namespaces as hosts, and the
one daemon launcher the demo, the benchmarks and the tests share (``kvpushd_lab.launch``).

It uses the daemon's public modules only (``kvpushd.config``, ``kvpushd.core``, ``kvpushd.transfer.descs``,
``kvpushd.memory.shm``, ``kvpushd.ctl``) and the client library; nothing in kvpushd imports it. Keep this
file light: ``kvpushd`` imports ``kvpushd_lab.commands`` to find ``demo`` and ``bench``.
"""
