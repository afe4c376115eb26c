"""``tc`` commands that shape a host's links with htb (this kernel has tbf and htb, no netem). Pure: they return
argv lists; ``Testbed`` runs them in the right namespace.

Sender side (the host's ``eth0`` egress, i.e. its upload): an htb root class at the host's upload rate, one leaf per
destination with a pair rate (a ``u32`` filter on the destination address), and a default leaf for the rest (ARP,
routers). Receiver side (the bridge port's egress towards the host, i.e. its download): one htb class. Every leaf
class queues at most 50 ms of its traffic (``leaf_queue``).
"""

from __future__ import annotations

UNSHAPED = 100e9  # bits/s of a class that stands for "no limit": far above what a veth carries here
DEFAULT_MINOR = 0xFFFE
FAST = 200e6  # from this rate on, classes get an explicit burst of 2 ms of traffic (htb's default loses ~5% at 1G)
QUEUE_S = 0.05  # each shaped class queues at most 50 ms of its traffic (see ``leaf_queue``)
MTU_FRAME = 1514
MIN_QUEUE_BYTES = 2 * 65536 + 2 * MTU_FRAME  # veths hand htb segmentation-offloaded packets of up to 64 KiB


def tc_rate(bits_per_s: float) -> str:
    """``tc``'s spelling of a rate, exact to the bit."""
    return f"{int(round(bits_per_s))}bit"


def _class(dev: str, parent: str, classid: str, rate: float, ceil: float) -> list[str]:
    argv = ["tc", "class", "add", "dev", dev, "parent", parent, "classid", classid, "htb",
            "rate", tc_rate(rate), "ceil", tc_rate(ceil)]
    quantum = int(max(3028, min(200_000, rate / 8 / 10)))
    argv += ["quantum", str(quantum)]
    if max(rate, ceil) >= FAST:
        burst = str(int(max(rate, ceil) / 8 * 0.002))
        argv += ["burst", burst, "cburst", burst]
    return argv


def leaf_queue(dev: str, classid: str, rate: float) -> list[str]:
    """A byte-limited fifo under a leaf class: at most ``QUEUE_S`` of the class's rate (16 to 1,000 frames).

    Without it a leaf queues the device's ``txqueuelen`` (1,000 frames: 1.5 s at 8 Mbit/s), and on a link busy
    both ways the other direction's acknowledgements and libp2p's flow-control window updates wait behind that
    second and a half of data: a slow link then carried ~40% of its rate. 50 ms is a modest home router's queue.
    """
    limit = int(min(1000 * MTU_FRAME, max(MIN_QUEUE_BYTES, rate * QUEUE_S / 8)))
    return ["tc", "qdisc", "add", "dev", dev, "parent", classid, "bfifo", "limit", str(limit)]


def leaf_minor(dst_index: int) -> int:
    """The class minor (hex in tc) of the leaf towards host ``dst_index``."""
    if not 0 <= dst_index < DEFAULT_MINOR - 16:
        raise ValueError(f"host index {dst_index} out of range")
    return dst_index + 16


def upload_commands(dev: str, up: float | None, pairs: dict[str, float]) -> list[list[str]]:
    """Shape ``dev``'s egress: total ``up`` bits/s (None: unlimited) and ``pairs`` {dst address: bits/s}.

    ``pairs`` keys may be given in any order; each gets a leaf whose minor is its position in sorted order + 16.
    """
    if up is None and not pairs:
        return []
    total = UNSHAPED if up is None else float(up)
    cmds = [["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", f"{DEFAULT_MINOR:x}"],
            _class(dev, "1:", "1:1", total, total),
            _class(dev, "1:1", f"1:{DEFAULT_MINOR:x}", total, total),
            leaf_queue(dev, f"1:{DEFAULT_MINOR:x}", total)]
    for k, (address, rate) in enumerate(sorted(pairs.items(), key=lambda kv: _ip_key(kv[0]))):
        leaf = min(float(rate), total)
        minor = f"{leaf_minor(k):x}"
        cmds.append(_class(dev, "1:1", f"1:{minor}", leaf, leaf))
        cmds.append(leaf_queue(dev, f"1:{minor}", leaf))
        cmds.append(["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                     "match", "ip", "dst", f"{address}/32", "flowid", f"1:{minor}"])
    return cmds


def download_commands(dev: str, down: float | None) -> list[list[str]]:
    """Shape ``dev``'s egress (the bridge port towards a host) to ``down`` bits/s; nothing for None."""
    if down is None:
        return []
    return [["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"],
            _class(dev, "1:", "1:1", float(down), float(down)), leaf_queue(dev, "1:1", float(down))]


def _ip_key(address: str) -> tuple[int, ...]:
    return tuple(int(part) for part in address.split("."))
