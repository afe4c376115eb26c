"""The workload estimator on hand-computed cases: one stage, two stages, a slow link, pipeline fill, a codec,
chain vs star, shared uplinks, the commit, and the inputs it refuses."""

from __future__ import annotations

import pytest

from swarm.estimator import (
    CLIENT,
    TCP_PAYLOAD_FRACTION,
    ClientCompute,
    Codec,
    Compute,
    Link,
    ModelShape,
    Pipeline,
    Stage,
    StreamCost,
    estimate_inference,
    estimate_training,
)
from swarm.estimator.events import Use, Wait, run

FREE = StreamCost(send_s=0.0, recv_s=0.0, cpu_s_per_byte=0.0, transit_s=0.0, daemon_rate=1e18)  # only the links
MODEL = ModelShape(hidden_size=1000, num_blocks=8, dtype_bytes=4)  # one token's hidden state: 4,000 bytes


def mbps(megabytes_per_s: float, latency: float = 0.0, **kwargs) -> Link:
    """A link that carries ``megabytes_per_s`` MB/s of TCP payload."""
    return Link(megabytes_per_s * 8e6 / TCP_PAYLOAD_FRACTION, latency, **kwargs)


FAST = mbps(1e12)


def star_links(*peers: str, link: Link = FAST, **special: Link) -> dict[tuple[str, str], Link]:
    links = {}
    for p in peers:
        links[(CLIENT, p)] = special.get(f"to_{p}", link)
        links[(p, CLIENT)] = special.get(f"from_{p}", link)
    return links


def all_links(*peers: str, link: Link = FAST) -> dict[tuple[str, str], Link]:
    names = [CLIENT, *peers]
    return {(a, b): link for a in names for b in names if a != b}


def only_forward(f: float, blocks: int = 1) -> Compute:
    return Compute(forward_s=f / blocks)  # per token per block: 1 token through ``blocks`` blocks costs ``f``


# ---- inference -----------------------------------------------------------------------------------------------
def test_one_stage_over_a_slow_link_is_compute_plus_two_transfers_and_latencies():
    compute = Compute(forward_s=1e-4, forward_fixed_s=1e-3)  # 4 blocks x (1 ms + 1 token x 0.1 ms) = 4.4 ms
    pipeline = Pipeline((Stage("a", 0, 8, compute),), star_links("a", link=mbps(1.0, latency=0.010)))
    est = estimate_inference(MODEL, pipeline, stream=FREE)
    # 8 blocks x 1.1 ms = 8.8 ms; 4,000 B at 1 MB/s = 4 ms each way; 10 ms latency each way
    assert est.compute_s == pytest.approx(8.8e-3)
    assert est.link_s == pytest.approx(8e-3)
    assert est.latency_s == pytest.approx(20e-3)
    assert est.token_latency_s == pytest.approx(36.8e-3)
    assert [(t.src, t.dst, t.bytes) for t in est.transfers] == [(CLIENT, "a", 4000), ("a", CLIENT, 4000)]


def test_two_stages_in_star_pay_four_messages_and_the_client():
    stages = (Stage("a", 0, 4, only_forward(0.002, 4)), Stage("b", 4, 8, only_forward(0.003, 4)))
    pipeline = Pipeline(stages, star_links("a", "b", link=mbps(2.0)), client=ClientCompute(forward_s=1e-3))
    est = estimate_inference(MODEL, pipeline, stream=FREE)
    assert [s.forward_s for s in est.stages] == pytest.approx([0.002, 0.003])
    assert est.link_s == pytest.approx(4 * 2e-3)  # 4,000 B at 2 MB/s, four times
    assert est.token_latency_s == pytest.approx(0.001 + 0.005 + 0.008)
    assert est.tokens_per_s == pytest.approx(1 / 0.014)


def test_a_batch_of_tokens_scales_bytes_and_per_token_compute_not_the_fixed_part():
    compute = Compute(forward_s=1e-4, forward_fixed_s=1e-3)
    pipeline = Pipeline((Stage("a", 0, 8, compute),), star_links("a", link=mbps(1.0)))
    est = estimate_inference(MODEL, pipeline, batch=2, tokens=5, stream=FREE)  # 10 rows
    assert est.compute_s == pytest.approx(8 * (1e-3 + 10 * 1e-4))
    assert est.transfers[0].bytes == 40_000
    assert est.link_s == pytest.approx(0.08)


def test_stream_costs_are_paid_at_both_ends_of_every_message():
    stream = StreamCost(send_s=1e-4, recv_s=2e-4, cpu_s_per_byte=1e-9, transit_s=5e-4, daemon_rate=1e18,
                        frame_bytes=1000)
    pipeline = Pipeline((Stage("a", 0, 8, Compute(forward_s=0.0)),), star_links("a", link=mbps(1.0)))
    est = estimate_inference(MODEL, pipeline, stream=stream)
    # each message: 5,000 B; CPU 1e-4 + 2e-4 + 2 x 5e-6; transit 5e-4; link 5 ms
    assert est.transfers[0].bytes == 5000
    assert est.stream_s == pytest.approx(2 * (3e-4 + 1e-5 + 5e-4))
    assert est.token_latency_s == pytest.approx(2 * (3.1e-4 + 5e-4 + 5e-3))


def test_the_daemons_rate_caps_a_fast_link():
    stream = StreamCost(send_s=0, recv_s=0, cpu_s_per_byte=0, transit_s=0, daemon_rate=1e6)  # 1 MB/s
    pipeline = Pipeline((Stage("a", 0, 8, Compute(forward_s=0.0)),), star_links("a"))
    assert estimate_inference(MODEL, pipeline, stream=stream).link_s == pytest.approx(8e-3)


def test_a_slow_link_dominates_the_latency():
    stages = tuple(Stage(p, 2 * i, 2 * i + 2, only_forward(1e-4, 2)) for i, p in enumerate("abcd"))
    links = star_links(*"abcd", link=mbps(1000.0), to_c=mbps(0.5), from_c=mbps(0.5))  # 8 ms each way to c
    est = estimate_inference(MODEL, Pipeline(stages, links), stream=FREE)
    assert est.token_latency_s == pytest.approx(4e-4 + 6 * 4e-6 + 2 * 8e-3)
    assert est.link_s / est.token_latency_s > 0.95


def test_chain_sends_one_message_per_hop_and_star_two_per_stage():
    stages = (Stage("a", 0, 4, only_forward(0.001, 4)), Stage("b", 4, 8, only_forward(0.001, 4)))
    links = all_links("a", "b", link=mbps(1.0, latency=0.005))
    star = estimate_inference(MODEL, Pipeline(stages, links), stream=FREE)
    chain = estimate_inference(MODEL, Pipeline(stages, links, topology="chain"), stream=FREE)
    assert [(t.src, t.dst) for t in chain.transfers] == [(CLIENT, "a"), ("a", "b"), ("b", CLIENT)]
    assert star.token_latency_s == pytest.approx(0.002 + 4 * (0.004 + 0.005))
    assert chain.token_latency_s == pytest.approx(0.002 + 3 * (0.004 + 0.005))


def test_a_codec_halving_the_bytes_halves_the_link_time():
    pipeline = Pipeline((Stage("a", 0, 8, Compute(forward_s=0.0)),), star_links("a", link=mbps(1.0)),
                        codec=Codec("fp16", bytes_per_element=2))
    est = estimate_inference(MODEL, pipeline, stream=FREE)
    assert est.transfers[0].bytes == 2000
    assert est.link_s == pytest.approx(4e-3)


def test_a_codec_of_the_tensor_size_and_a_per_link_override():
    top_k = Codec("top1%", size=lambda n: n // 100 * 8)  # 1% of the values, 4-byte value + 4-byte index each
    links = star_links("a", link=mbps(1.0))
    links[("a", CLIENT)] = mbps(1.0, codec=top_k)  # only the slow direction compresses
    est = estimate_inference(MODEL, Pipeline((Stage("a", 0, 8, Compute(forward_s=0.0)),), links), stream=FREE)
    assert [t.bytes for t in est.transfers] == [4000, 80]


# ---- training ------------------------------------------------------------------------------------------------
def two_compute_stages(client_turn: float = 0.0, b_forward: float = 1.0) -> Pipeline:
    """Two stages, forward 1 s (b: ``b_forward``), backward 2 s per micro-batch of one token; links and stream free;
    the head and loss take ``client_turn``."""
    stages = (Stage("a", 0, 4, Compute(forward_s=1.0 / 4, backward_s=2.0 / 4)),
              Stage("b", 4, 8, Compute(forward_s=b_forward / 4, backward_s=2.0 / 4)))
    return Pipeline(stages, star_links("a", "b"), client=ClientCompute(fixed_s=client_turn))


def test_k1_runs_micro_batches_one_after_another():
    est = estimate_training(MODEL, two_compute_stages(0.5, 1.5), rows=1, seq_len=1, micro_batches=2, in_flight=1,
                            stream=FREE)
    assert est.micro_batch_latency_s == pytest.approx(7.0)  # F 1 + F 1.5 + head 0.5 + B 2 + B 2
    assert est.step_s == pytest.approx(14.0)
    assert est.tokens_per_s == pytest.approx(2 / 14.0)


def test_k2_fills_the_pipeline_by_hand():
    # each stage serves its stream in order of arrival, forwards and backwards alike:
    # mb0: a.F 0-1, b.F 1-2.5, head 2.5-3, b.B 4-6 (behind mb1's b.F, which came at 2), a.B 6-8
    # mb1: a.F 1-2, b.F 2.5-4 (behind mb0's), head 4-4.5, b.B 6-8 (behind mb0's), a.B 8-10 (behind mb0's)
    est = estimate_training(MODEL, two_compute_stages(0.5, 1.5), rows=1, seq_len=1, micro_batches=2, in_flight=2,
                            stream=FREE)
    assert est.micro_batches_s == pytest.approx(10.0)  # K=1: 14
    assert est.busy_s["stage:a"] == pytest.approx(6.0)
    assert est.busy_s["stage:b"] == pytest.approx(7.0)
    assert est.busy_s["client"] == pytest.approx(1.0)
    assert est.bottleneck == "stage:b"


def test_many_micro_batches_in_flight_approach_the_bottleneck():
    kwargs = dict(rows=1, seq_len=1, micro_batches=100, stream=FREE)
    serial = estimate_training(MODEL, two_compute_stages(), in_flight=1, **kwargs)
    est = estimate_training(MODEL, two_compute_stages(), in_flight=8, **kwargs)
    assert serial.step_s == pytest.approx(600.0)  # 100 x (1 + 1 + 2 + 2)
    assert est.bottleneck in ("stage:a", "stage:b")
    assert est.busy_s["stage:a"] == pytest.approx(300.0)  # 3 s per micro-batch
    assert 300.0 <= est.step_s <= 0.6 * serial.step_s  # never below the bottleneck's work; most of the bubble gone
    assert est.tokens_per_s == pytest.approx(100 / est.step_s)


def test_a_slow_training_link_is_the_bottleneck_and_caps_throughput():
    compute = Compute(forward_s=1e-6, backward_s=2e-6)
    stages = (Stage("a", 0, 4, compute), Stage("b", 4, 8, compute))
    links = star_links("a", "b", link=mbps(1000.0), to_b=mbps(1.0), from_b=mbps(1.0))
    # 16 rows x 16 tokens x 1000 x 4 B = 1.024 MB per message; to b: forward input + backward grad = 2.048 s
    est = estimate_training(MODEL, Pipeline(stages, links), rows=16, seq_len=16, micro_batches=20, in_flight=4,
                            stream=FREE)
    assert est.bottleneck in (f"link:{CLIENT}->b", f"link:b->{CLIENT}")
    assert est.busy_s[f"link:{CLIENT}->b"] == pytest.approx(20 * 2.048)
    assert est.tokens_per_s == pytest.approx(20 * 256 / est.step_s)
    assert est.tokens_per_s < 256 / 2.048 * 1.001
    assert est.cut_bytes == ((1.024e6, 1.024e6),)


def test_recompute_sends_the_input_again_with_the_gradient_and_runs_the_forward_again():
    compute = Compute(forward_s=0.25, backward_s=0.5)
    pipeline = Pipeline((Stage("a", 0, 8, compute),), star_links("a", link=mbps(1.0)))
    plain = estimate_training(MODEL, pipeline, rows=1, seq_len=1, micro_batches=1, in_flight=1, stream=FREE)
    again = estimate_training(MODEL, pipeline, rows=1, seq_len=1, micro_batches=1, in_flight=1, stream=FREE,
                              recompute=True)
    assert [t.bytes for t in plain.transfers] == [4000, 4000, 4000, 4000]
    assert [t.bytes for t in again.transfers] == [4000, 4000, 8000, 4000]
    assert again.stages[0].backward_s == pytest.approx(plain.stages[0].backward_s + 2.0)
    assert again.step_s - plain.step_s == pytest.approx(2.0 + 4e-3)


def test_chain_training_goes_down_the_chain_and_back_up():
    stages = (Stage("a", 0, 4, Compute(forward_s=0.0)), Stage("b", 4, 8, Compute(forward_s=0.0)))
    links = all_links("a", "b", link=mbps(1.0))
    star = estimate_training(MODEL, Pipeline(stages, links), rows=1, seq_len=1, micro_batches=1, in_flight=1,
                             stream=FREE)
    chain = estimate_training(MODEL, Pipeline(stages, links, topology="chain"), rows=1, seq_len=1, micro_batches=1,
                              in_flight=1, stream=FREE)
    assert [(t.src, t.dst) for t in chain.transfers] == [
        (CLIENT, "a"), ("a", "b"), ("b", CLIENT), (CLIENT, "b"), ("b", "a"), ("a", CLIENT)]
    assert star.micro_batch_latency_s == pytest.approx(8 * 4e-3)
    assert chain.micro_batch_latency_s == pytest.approx(6 * 4e-3)


def test_the_commit_waits_for_the_slowest_stage_then_the_trainers_own_step():
    stages = (Stage("a", 0, 4, Compute(forward_s=0.0, apply_s=0.1)), Stage("b", 4, 8, Compute(forward_s=0.0,
                                                                                              apply_s=0.3)))
    pipeline = Pipeline(stages, star_links("a", "b", link=mbps(1.0, latency=0.01)),
                        client=ClientCompute(apply_s=0.05))
    est = estimate_training(MODEL, pipeline, rows=1, seq_len=1, micro_batches=1, in_flight=1, stream=FREE)
    assert [s.apply_s for s in est.stages] == pytest.approx([0.4, 1.2])  # per block x 4 blocks
    assert est.commit_s == pytest.approx(1.2 + 2 * 0.01 + 0.05)  # commit messages are empty: latency only
    assert est.step_s == pytest.approx(est.micro_batches_s + est.commit_s)


def test_links_sharing_an_uplink_queue_on_each_other():
    compute = Compute(forward_s=0.0)
    stages = (Stage("a", 0, 4, compute), Stage("b", 4, 8, compute))
    separate = star_links("a", "b", link=mbps(1.0))
    shared = dict(separate)
    shared[(CLIENT, "a")] = mbps(1.0, shared="client-up")
    shared[(CLIENT, "b")] = mbps(1.0, shared="client-up")
    kwargs = dict(rows=1, seq_len=1, micro_batches=10, in_flight=10, stream=FREE)
    apart = estimate_training(MODEL, Pipeline(stages, separate), **kwargs)
    together = estimate_training(MODEL, Pipeline(stages, shared), **kwargs)
    assert together.busy_s["link:client-up"] == pytest.approx(10 * 4 * 4e-3)  # 4 uploads per micro-batch
    assert together.step_s > apart.step_s
    assert together.step_s >= 10 * 4 * 4e-3


# ---- the event run -------------------------------------------------------------------------------------------
def test_events_serve_first_come_first_served_and_waits_hold_nothing():
    jobs = [[Use("r", 2.0), Wait(1.0), Use("r", 1.0)], [Use("r", 1.0)]]
    result = run(jobs, in_flight=2)
    # job0 r 0-2, job1 r 2-3, job0 waits 2-3 then r 3-4
    assert result.ends == (4.0, 3.0)
    assert result.busy == {"r": 4.0}
    assert run(jobs, in_flight=1).ends == (4.0, 5.0)


# ---- refusals ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("make", "message"), [
    (lambda: Pipeline((), {}), "at least one stage"),
    (lambda: Pipeline((Stage("a", 0, 4, Compute(0.0)), Stage("b", 5, 8, Compute(0.0))), star_links("a", "b")),
     "contiguous"),
    (lambda: Pipeline((Stage("a", 0, 8, Compute(0.0)),), {}), r"no link client -> a"),
    (lambda: Pipeline((Stage("a", 0, 8, Compute(0.0)),), star_links("a"), topology="ring"), "topology"),
    (lambda: Pipeline((Stage(CLIENT, 0, 8, Compute(0.0)),), star_links(CLIENT)), "names the client"),
    (lambda: Compute(forward_s=-1.0), "forward_s must be a finite number >= 0"),
    (lambda: Compute(forward_s=float("nan")), "forward_s"),
    (lambda: Link(0.0), "bandwidth must be a finite number > 0"),
    (lambda: ModelShape(hidden_size=0, num_blocks=8), "hidden_size"),
    (lambda: Codec("x", bytes_per_element=0.0), "bytes_per_element"),
])
def test_bad_inputs_are_refused_with_a_message(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_stages_that_do_not_cover_the_model_and_missing_chain_links_are_refused():
    half = Pipeline((Stage("a", 0, 4, Compute(0.0)),), star_links("a"))
    with pytest.raises(ValueError, match="cover blocks 0:4, the model has 0:8"):
        estimate_inference(MODEL, half, stream=FREE)
    stages = (Stage("a", 0, 4, Compute(0.0)), Stage("b", 4, 8, Compute(0.0)))
    forward_only = {(CLIENT, "a"): FAST, ("a", "b"): FAST, ("b", CLIENT): FAST}
    chain = Pipeline(stages, forward_only, topology="chain")
    assert estimate_inference(MODEL, chain, stream=FREE).token_latency_s == pytest.approx(3 * 4e-15, abs=1e-9)
    with pytest.raises(ValueError, match="no link client -> b"):
        estimate_training(MODEL, chain, rows=1, seq_len=1, micro_batches=1, in_flight=1, stream=FREE)
    with pytest.raises(ValueError, match="in_flight must be an integer >= 1"):
        estimate_training(MODEL, two_compute_stages(), rows=1, seq_len=1, micro_batches=1, in_flight=0, stream=FREE)


def test_stages_sharing_one_core_cannot_overlap_their_compute():
    # the K=2 case above, on one core: nothing overlaps, so the step is all the CPU work one after another
    est = estimate_training(MODEL, two_compute_stages(0.5, 1.5), rows=1, seq_len=1, micro_batches=2, in_flight=2,
                            stream=FREE, cores=1)
    assert est.micro_batches_s == pytest.approx(2 * 7.0)
    two = estimate_training(MODEL, two_compute_stages(0.5, 1.5), rows=1, seq_len=1, micro_batches=2, in_flight=2,
                            stream=FREE, cores=2)
    assert two.micro_batches_s == pytest.approx(10.0)  # two cores are enough for the two stages' overlap here


def test_a_job_waiting_for_a_core_keeps_its_resource_and_links_need_no_core():
    jobs = [[Use("a", 2.0, core=True)], [Use("b", 1.0, core=True)], [Use("link", 1.5)]]
    result = run(jobs, in_flight=3, cores=1)
    assert result.ends == (2.0, 3.0, 1.5)
    with pytest.raises(ValueError, match="cores must be >= 1"):
        run(jobs, in_flight=1, cores=0)
