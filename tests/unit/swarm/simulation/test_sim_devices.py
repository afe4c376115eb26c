"""Device figures from spec sheets: per-token seconds from FLOPs, blocks from memory; links from hosts."""

from __future__ import annotations

import random

import pytest

from swarm.simulation.devices import CATALOG, MODELS, UTILISATION, figures
from swarm.simulation.network import SITE_RTT, datacenter_host, home_host, link


def test_llama_13b_block_and_a_3080s_figures():
    model = MODELS["llama-2-13b"]
    assert model.params_per_block == 317_204_480  # 4 x 5120^2 + 3 x 5120 x 13824 + two norms
    f = figures(CATALOG["rtx3080"], model, "adapters")
    assert f.forward_s == pytest.approx(2 * 317_204_480 / (59.5e12 * UTILISATION))
    assert f.backward_s == pytest.approx(2 * f.forward_s)
    assert f.max_blocks == int(10e9 * 0.8 // (317_204_480 * 2))  # 12 fp16 blocks in 8 GB
    assert figures(CATALOG["rtx3080"], model, "full").max_blocks == 1  # 16 bytes per weight: one block
    assert figures(CATALOG["h100"], model, "adapters").max_blocks == 40  # the whole model
    with pytest.raises(ValueError, match="memory"):
        figures(CATALOG["h100"], model, "int3")


def test_links_between_hosts():
    rng = random.Random(0)
    a, b = home_host(rng, "eu", "a"), home_host(rng, "eu", "b")
    bandwidth, rtt = link(a, b)
    assert bandwidth == min(a.up_bps, b.down_bps)
    assert a.up_bps <= a.down_bps
    assert 0.008 <= rtt <= 0.15
    far = home_host(rng, "asia", "c")
    assert link(a, far)[1] > 0.15  # Europe to Asia: the region's 150 ms plus both last miles
    d1, d2 = datacenter_host("dc", "eu", 100e9), datacenter_host("dc", "eu", 100e9)
    assert link(d1, d2) == (100e9, SITE_RTT)
