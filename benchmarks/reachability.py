"""What the reachability check costs a joining node on 127.0.0.1: ``python benchmarks/reachability.py``.

A helper (forced public, like ``swarm dht``) and, in turn, a node joining it three ways, interleaved per round:
no check (the baseline), the direct check (the helper dials it back from a fresh probe daemon), and forced
private (straight behind the helper as its relay, started once the relay dialled it through itself). Prints
JSON: medians of each start in seconds, and the check's cost over the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from tqdm import tqdm

from swarm.discovery import start_node, visible_maddrs
from swarm.nat import NatOptions


async def _timed(**kwargs) -> float:
    t0 = time.perf_counter()
    node = await start_node(**kwargs)
    elapsed = time.perf_counter() - t0
    await node.shutdown()
    return elapsed


async def main(rounds: int) -> dict:
    helper = await start_node(nat=NatOptions(force_reachability="public"))
    try:
        boot = (await visible_maddrs(helper))[0]
        times: dict[str, list[float]] = {"no_check": [], "direct_check": [], "behind_relay": []}
        for _ in tqdm(range(rounds), desc="rounds"):
            times["no_check"].append(await _timed(initial_peers=[boot], nat=NatOptions(use_auto_relay=True)))
            times["direct_check"].append(await _timed(initial_peers=[boot], check_reachability=True,
                                                      nat=NatOptions(use_auto_relay=True)))
            times["behind_relay"].append(await _timed(initial_peers=[boot], check_reachability=True, nat=NatOptions(
                use_auto_relay=True, force_reachability="private")))
    finally:
        await helper.shutdown()
    medians = {k: round(statistics.median(v), 3) for k, v in times.items()}
    return {"rounds": rounds, "median_start_s": medians,
            "direct_check_cost_s": round(medians["direct_check"] - medians["no_check"], 3),
            "behind_relay_cost_s": round(medians["behind_relay"] - medians["no_check"], 3)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    print(json.dumps(asyncio.run(main(parser.parse_args().rounds)), indent=2))
