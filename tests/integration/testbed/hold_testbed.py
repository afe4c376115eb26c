"""Make a testbed with a NAT host and two processes in it, print its names as JSON, then wait to be killed.

Used by test_testbed_cleanup.py: ``python hold_testbed.py`` (SIGKILL, SIGTERM or SIGINT it).
"""

from __future__ import annotations

import json
import sys
import time

from swarm.testbed import Testbed
from swarm.testbed.netns import pids_in_netns

with Testbed(3, "three_sites") as tb:
    nat = tb.add_nat_host()
    tb.spawn(tb.hosts[0], ["sleep", "1000"], name="sleeper")
    tb.spawn(nat, ["sh", "-c", "setsid sleep 1000 & sleep 1000"], name="escaper")  # one leaves the group
    time.sleep(0.3)
    inside = sorted({pid for ns in tb.state.namespaces for pid in pids_in_netns(ns)})  # incl. the one that left
    print(json.dumps({"prefix": tb.prefix, "pids": inside, "namespaces": tb.state.namespaces}), flush=True)
    try:
        time.sleep(1000)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        raise
sys.exit(0)
