"""An emulated wide-area network on one machine, for tests and benchmarks (root needed; issue 11).

``Testbed(hosts, matrix)`` makes each host a network namespace with one veth to a Linux bridge. The bridge lives in a
namespace of its own, so the root namespace's firewall/br_netfilter/docker rules never touch the traffic and the
root namespace gets no address (nothing outside the hosts can reach them). Every testbed has its own subnet
10.N.0.0/24. Links are shaped per ordered pair with htb (a class and a ``u32`` filter on the destination, on the
sender's side) and per host with an upload (host-side egress) and a download (bridge-side egress) limit; rates are
on the wire, so TCP goodput is ~95% of them (headers) at MTU 1500.

**No latency**: this kernel has no ``netem``, so links add no delay (round trips are ~0.1 ms); the estimator and
planner still take latency as an input. A NAT host (``add_nat_host``) sits behind a router namespace that
masquerades with nftables. Everything made is recorded first in a state file (``/run/fusionswarm-testbed``) and
removed on close, exception, KeyboardInterrupt and SIGTERM; ``python -m swarm.testbed cleanup`` removes what a
killed run left.

Modules: ``matrices`` (rates, pure), ``shaping`` (tc commands, pure), ``nat`` (nft ruleset, pure), ``netns``,
``procs``, ``state``, ``cleanup``, ``testbed`` (the ``Testbed``), ``tcp_rate`` (TCP goodput), ``verify``.
"""

from swarm.testbed.matrices import GBIT, MATRICES, MBIT, Matrix, rate_classes, resolve_matrix
from swarm.testbed.netns import require_nft, require_root
from swarm.testbed.testbed import Host, Testbed, TestbedError

__all__ = ["GBIT", "MATRICES", "MBIT", "Host", "Matrix", "Testbed", "TestbedError", "rate_classes", "require_nft",
           "require_root", "resolve_matrix"]
