"""The NAT router's nftables ruleset: masquerade what the inside sends out; forward nothing new inwards. Pure."""

from __future__ import annotations

NAT_TABLE = "fusionswarm_nat"


def nat_ruleset(outside_dev: str = "eth0", inside_dev: str = "lan0", table: str = NAT_TABLE) -> str:
    """An ``nft -f`` script for the router namespace.

    Outbound connections from ``inside_dev`` leave masqueraded as the router's own address; only their replies
    come back (conntrack). Nothing new is forwarded from ``outside_dev`` inwards (no port forwarding), and a
    connection to the router's own address finds no listener, so the inside host cannot be dialled.
    """
    return f"""table ip {table} {{
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "{outside_dev}" masquerade
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "{inside_dev}" oifname "{outside_dev}" accept
  }}
}}
"""
