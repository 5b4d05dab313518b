"""CPU of kvpushd daemons: idle, and with one Expect waiting (decode polling for a notification)."""
import json, os, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from conftest import start_daemon, make_kv  # noqa: E402
from kvpushd_client import Role  # noqa: E402

def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

def measure(pids, s):
    a = [cpu(p) for p in pids]; t = time.monotonic(); time.sleep(s); dt = time.monotonic() - t
    return [round(100 * (cpu(p) - x) / dt, 2) for p, x in zip(pids, a)]

with tempfile.TemporaryDirectory() as d:
    w = Path(d)
    cfg = "[transfer]\nexpect_timeout_s = 300.0\npublish_timeout_s = 300.0\n"
    p = start_daemon(w, "pnode", cfg); dn = start_daemon(w, "dnode", cfg)
    src, dst = make_kv("ab-src"), make_kv("ab-dst", fill="poison")
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    dw = dn.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    time.sleep(2)
    idle = measure([p.proc.pid, dn.proc.pid], 10)
    dw.expect("wait", [1], p.peer_address, "prefill", 1)
    time.sleep(1)
    waiting = measure([p.proc.pid, dn.proc.pid], 10)
    print(json.dumps({"idle_cpu_pct": {"prefill": idle[0], "decode": idle[1]},
                      "one_expect_waiting_cpu_pct": {"prefill": waiting[0], "decode": waiting[1]},
                      "loadavg": os.getloadavg()[0]}))
    for x in (p, dn):
        x.client.close(); x.stop()
    src.close(); dst.close()
