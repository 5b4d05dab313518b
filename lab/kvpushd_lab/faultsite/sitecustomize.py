"""Put on a daemon's PYTHONPATH by ``kvpushd_lab.faults.with_site``: installs the fault-injecting
NIXL agent (kvpushd_lab/faults.py) when KVPUSHD_FAULTS is set."""

import os

if os.environ.get("KVPUSHD_FAULTS"):
    from kvpushd_lab.faults import install

    try:
        install(os.environ["KVPUSHD_FAULTS"])
    except ValueError as e:  # a bad spec stops the daemon, as a bad config does
        raise SystemExit(str(e)) from None
