"""The reachability check: a joining peer asks peers it knows to dial it back, directly or through a relay.

The asking peer sends the addresses it announces; the helper (``swarm dht`` and every non-client node serve
:data:`HANDLE`) dials the *asking peer's own id* from a fresh, short-lived probe daemon that shares no
connection with it, so an answer "reachable" means a new connection to those addresses worked. Bounds, so
that the helper is no tool for making connections elsewhere:

* only addresses at the IP the asker's connection comes from (as libp2p's AutoNAT does), at most
  :data:`MAX_ADDRS`, never a relayed one, and only to the asker's peer id (the handshake checks it);
* a relayed check dials the asker only through the helper itself (``helper/p2p-circuit/p2p/asker``);
* one dial per check with a :data:`DIAL_TIMEOUT`; :data:`PER_CALLER` checks per caller and
  :data:`PER_HELPER` in all per minute, :data:`CONCURRENT` at once; beyond that the answer is "busy".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgpack
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

logger = logging.getLogger(__name__)

HANDLE = "fusionswarm.Reachability.dial_back"
MAX_MESSAGE = 4096  # bytes of a request or an answer
MAX_ADDRS = 8  # addresses dialled per check
MAX_ADDR_LEN = 256
DIAL_TIMEOUT = 5.0  # seconds for the probe's dial
READ_TIMEOUT = 5.0  # seconds for the request to arrive
PER_CALLER = 6  # checks per caller per WINDOW (a joining peer asks once directly, then a few times through a relay)
PER_HELPER = 30  # checks in all per WINDOW
WINDOW = 60.0
CONCURRENT = 2  # probes at once; more checks wait up to QUEUE_WAIT seconds, then get "busy"
QUEUE_WAIT = 10.0
ASK_TIMEOUT = 25.0  # seconds an asker waits for one helper's answer (queue + probe start + dial)
MAX_HELPERS = 3  # helpers asked at once
_PROBE_ARGS = dict(dht_mode="client", auto_nat=False, nat_port_map=False, no_listen=True, startup_timeout=10)


class RateLimiter:
    """At most ``per_key`` events per key and ``total`` in all within a sliding ``window`` of seconds."""

    def __init__(self, per_key: int, total: int, window: float, clock: Callable[[], float] = time.monotonic):
        self.per_key, self.total, self.window, self.clock = per_key, total, window, clock
        self._events: deque[tuple[float, str]] = deque()

    def allow(self, key: str) -> str | None:
        """Record an event of ``key`` and return None, or return why it is refused (nothing recorded)."""
        now = self.clock()
        while self._events and self._events[0][0] <= now - self.window:
            self._events.popleft()
        if sum(1 for _, k in self._events if k == key) >= self.per_key:
            return f"busy: at most {self.per_key} reachability checks per caller per {self.window:.0f} s"
        if len(self._events) >= self.total:
            return f"busy: this peer runs at most {self.total} reachability checks per {self.window:.0f} s"
        self._events.append((now, key))
        return None


# ---- addresses (pure) ------------------------------------------------------------------------------------------

def _parts(maddr: str) -> list[str]:
    return maddr.strip("/").split("/") if maddr.startswith("/") else []


def host_of(maddr: str) -> str | None:
    """The IP of ``/ip4/A/...`` or ``/ip6/A/...``; None for other multiaddrs."""
    parts = _parts(maddr)
    return parts[1] if len(parts) >= 2 and parts[0] in ("ip4", "ip6") else None


def is_relayed(maddr: str) -> bool:
    return "p2p-circuit" in _parts(maddr)


def dialable(addrs: Sequence[str], observed: str, peer_id: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Which of the asker's ``addrs`` a helper dials, and why it skips the others.

    ``observed`` is the remote address of the asker's connection to the helper. A dialled address has no
    /p2p/ suffix (the probe dials ``peer_id`` there).
    """
    observed_ip = host_of(observed)
    dial: list[str] = []
    skipped: list[tuple[str, str]] = []
    for addr in addrs:
        parts = _parts(addr)
        if is_relayed(addr):
            skipped.append((addr, "a relayed address (checked separately)"))
            continue
        if "p2p" in parts:
            i = parts.index("p2p")
            if parts[i + 1:i + 2] != [peer_id] or len(parts) != i + 2:
                skipped.append((addr, "names another peer id than yours"))
                continue
            parts = parts[:i]
        if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] not in ("tcp", "udp"):
            skipped.append((addr, "not an /ip4|ip6/ADDRESS/tcp|udp/PORT address"))
            continue
        if not parts[3].isdigit() or not 0 < int(parts[3]) < 65536:
            skipped.append((addr, "no valid port"))
            continue
        if parts[1] != observed_ip:
            skipped.append((addr, f"not the IP you connect from ({observed_ip or observed})"))
            continue
        plain = "/" + "/".join(parts)
        if plain not in dial and len(dial) < MAX_ADDRS:
            dial.append(plain)
    return dial, skipped


# ---- messages --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CheckRequest:
    addrs: tuple[str, ...]  # the asker's announced addresses, to be dialled directly
    relayed: bool = False  # also dial the asker through the helper (a relay)

    def to_bytes(self) -> bytes:
        return msgpack.packb({"addrs": list(self.addrs), "relayed": self.relayed})

    @classmethod
    def from_bytes(cls, raw: bytes) -> CheckRequest:
        """Parse a request; ``ValueError`` with a readable reason if malformed."""
        value = _unpack(raw)
        addrs, relayed = value.get("addrs", []), value.get("relayed", False)
        if not isinstance(addrs, list) or not all(isinstance(a, str) and len(a) <= MAX_ADDR_LEN for a in addrs):
            raise ValueError(f"addrs must be a list of strings of at most {MAX_ADDR_LEN} characters")
        if len(addrs) > 4 * MAX_ADDRS:
            raise ValueError(f"at most {4 * MAX_ADDRS} addresses per check")
        if not isinstance(relayed, bool):
            raise ValueError("relayed must be true or false")
        return cls(tuple(addrs), relayed)


@dataclass(frozen=True)
class Dial:
    """One dial-back: whether it connected, at which address, or why not."""

    ok: bool
    addr: str = ""
    error: str = ""

    def to_wire(self) -> dict:
        return {"ok": self.ok, "addr": self.addr, "error": self.error}

    @classmethod
    def from_wire(cls, value: object) -> Dial | None:
        if value is None:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("ok"), bool):
            raise ValueError("a dial result must be a map with a boolean 'ok'")
        addr, error = value.get("addr", ""), value.get("error", "")
        if not isinstance(addr, str) or not isinstance(error, str):
            raise ValueError("a dial result's addr and error must be strings")
        return cls(value["ok"], addr[:MAX_ADDR_LEN], error[:512])


@dataclass(frozen=True)
class CheckAnswer:
    """A helper's answer: what it saw us connect from, the direct dial, the skipped addresses, the relayed dial."""

    helper: str = ""
    observed: str = ""
    direct: Dial | None = None
    skipped: tuple[tuple[str, str], ...] = ()
    relayed: Dial | None = None
    refused: str = ""  # the helper did not check (busy, or a bad request)

    def to_bytes(self) -> bytes:
        return msgpack.packb({
            "observed": self.observed, "direct": self.direct.to_wire() if self.direct else None,
            "skipped": [list(s) for s in self.skipped][:MAX_ADDRS],
            "relayed": self.relayed.to_wire() if self.relayed else None, "refused": self.refused,
        })

    @classmethod
    def from_bytes(cls, raw: bytes, helper: str) -> CheckAnswer:
        value = _unpack(raw)
        skipped = value.get("skipped", [])
        if not isinstance(skipped, list) or not all(
                isinstance(s, list) and len(s) == 2 and all(isinstance(x, str) for x in s) for s in skipped):
            raise ValueError("skipped must be a list of [address, reason] pairs")
        observed, refused = value.get("observed", ""), value.get("refused", "")
        if not isinstance(observed, str) or not isinstance(refused, str):
            raise ValueError("observed and refused must be strings")
        return cls(helper=helper, observed=observed[:MAX_ADDR_LEN], direct=Dial.from_wire(value.get("direct")),
                   skipped=tuple((a[:MAX_ADDR_LEN], r[:200]) for a, r in skipped),
                   relayed=Dial.from_wire(value.get("relayed")), refused=refused[:512])


def _unpack(raw: bytes) -> dict:
    if len(raw) > MAX_MESSAGE:
        raise ValueError(f"message of {len(raw)} bytes exceeds {MAX_MESSAGE}")
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_str_len=MAX_MESSAGE,
                                max_bin_len=0, max_array_len=64, max_map_len=16, max_ext_len=0)
    except Exception as e:
        raise ValueError(f"not a msgpack message ({type(e).__name__}: {e})") from None
    if not isinstance(value, dict):
        raise ValueError("a message must be a map")
    return value


async def _send(writer: asyncio.StreamWriter, payload: bytes) -> None:
    writer.write(len(payload).to_bytes(4, "big") + payload)
    await writer.drain()


async def _receive(reader: asyncio.StreamReader, timeout: float) -> bytes:
    async def read() -> bytes:
        size = int.from_bytes(await reader.readexactly(4), "big")
        if size > MAX_MESSAGE:
            raise ValueError(f"message of {size} bytes exceeds {MAX_MESSAGE}")
        return await reader.readexactly(size)

    return await asyncio.wait_for(read(), timeout)


# ---- the helper's side -----------------------------------------------------------------------------------------

class DialBackService:
    """Answers others' reachability checks on ``p2p`` (see the module's docstring for the bounds)."""

    def __init__(self, p2p: P2P, *, dial_timeout: float = DIAL_TIMEOUT, limiter: RateLimiter | None = None):
        self.p2p, self.dial_timeout = p2p, dial_timeout
        self.limiter = limiter or RateLimiter(PER_CALLER, PER_HELPER, WINDOW)
        self._slots = asyncio.Semaphore(CONCURRENT)
        self._tasks: set[asyncio.Task] = set()
        self._stopping: set[asyncio.Future] = set()  # probes' daemons on their way out
        self._spare: asyncio.Future[P2P] | None = None  # the next direct check's probe, starting or started

    async def attach(self) -> None:
        await self.p2p.add_binary_stream_handler(HANDLE, self._handle)

    async def detach(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        spare, self._spare = self._spare, None
        if spare is not None:  # never cancelled mid-start, which could leave its daemon running
            await asyncio.wait({spare}, timeout=15)
            if spare.done() and not spare.cancelled() and spare.exception() is None:
                self._stop_later(spare.result())
        if self._stopping:
            await asyncio.wait(list(self._stopping), timeout=5)
        try:
            await asyncio.wait_for(self.p2p.remove_binary_stream_handler(HANDLE), 3)
        except Exception as e:  # the daemon may be gone already
            logger.debug("could not remove the reachability handler: %r", e)

    async def _handle(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        caller = info.peer_id.to_base58()
        try:
            try:
                request = CheckRequest.from_bytes(await _receive(reader, READ_TIMEOUT))
                answer = await self.check(info.peer_id, str(info.addr), request)
            except (ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
                answer = CheckAnswer(observed=str(info.addr), refused=f"bad request: {e}")
                logger.info("Refused a reachability check from %s: %s", caller, answer.refused)
            except Exception as e:  # ours, not the caller's: it gets a reason, we keep serving
                logger.warning("A reachability check from %s failed here: %r", caller, e)
                answer = CheckAnswer(observed=str(info.addr), refused=f"the helper failed ({type(e).__name__})")
            await _send(writer, answer.to_bytes())
            await asyncio.wait_for(reader.read(1), READ_TIMEOUT)  # the asker closes once it has read the answer
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            logger.debug("reachability check of %s: the stream ended early (%r)", caller, e)
        finally:
            writer.close()
            if task is not None:
                self._tasks.discard(task)

    async def check(self, peer: PeerID, observed: str, request: CheckRequest) -> CheckAnswer:
        """Dial ``peer`` back as ``request`` asks, within the bounds."""
        peer_id = peer.to_base58()
        refused = self.limiter.allow(peer_id)
        if refused:
            return CheckAnswer(observed=observed, refused=refused)
        dial, skipped = dialable(request.addrs, observed, peer_id)
        try:
            await asyncio.wait_for(self._slots.acquire(), QUEUE_WAIT)
        except asyncio.TimeoutError:
            return CheckAnswer(observed=observed, refused=f"busy: {CONCURRENT} reachability checks are running")
        try:
            direct = None
            if request.addrs:
                direct = await self._dial(peer, dial, relayed=False) if dial else Dial(False, error="nothing to dial")
            relayed = None
            if request.relayed:
                own = [a for a in await self.p2p.get_visible_maddrs(latest=True) if not is_relayed(str(a))]
                relayed = await self._dial(peer, [f"{a}/p2p-circuit" for a in own], relayed=True)
        finally:
            self._slots.release()
        logger.info("Reachability check of %s from %s:%s%s", peer_id, observed,
                    "" if direct is None else f" direct {'ok' if direct.ok else f'failed ({direct.error})'}",
                    "" if relayed is None else f" through us {'ok' if relayed.ok else f'failed ({relayed.error})'}")
        return CheckAnswer(observed=observed, direct=direct, skipped=tuple(skipped), relayed=relayed)

    async def _dial(self, peer: PeerID, addrs: Sequence[str], *, relayed: bool) -> Dial:
        """Connect to ``peer`` at ``addrs`` from a fresh probe daemon (no shared connection, no address book)."""
        try:
            probe = await self._probe(relayed)
        except Exception as e:
            logger.warning("Could not start a probe daemon for a reachability check (%r)", e)
            return Dial(False, error=f"the helper could not start its probe ({type(e).__name__})")
        try:
            await asyncio.wait_for(_connect(probe, peer, addrs, self.dial_timeout), self.dial_timeout + 1)
            used = [str(a) for info in await probe.list_peers() if info.peer_id == peer for a in info.addrs]
            return Dial(True, addr=used[0] if used else addrs[0])
        except asyncio.TimeoutError:
            return Dial(False, error=f"no connection within {self.dial_timeout:.0f} s")
        except Exception as e:
            return Dial(False, error=_short(e))
        finally:
            self._stop_later(probe)

    async def _probe(self, relayed: bool) -> P2P:
        """A fresh probe daemon, used once. A direct check takes the spare started after the previous one (so the
        next asker does not wait for a daemon to start) and starts the next spare."""
        if relayed:
            return await P2P.create(use_relay=True, **_PROBE_ARGS)
        spare, self._spare = self._spare, asyncio.ensure_future(P2P.create(use_relay=False, **_PROBE_ARGS))
        if spare is not None:
            try:
                probe = await spare
                if probe._child is not None and probe._child.returncode is None:
                    return probe
                self._stop_later(probe)  # its daemon died while it waited
            except Exception as e:
                logger.debug("the spare probe daemon did not start (%r); starting another", e)
        return await P2P.create(use_relay=False, **_PROBE_ARGS)

    def _stop_later(self, probe: P2P) -> None:
        """Stop the probe's daemon without making the asker wait for it to exit."""
        task = asyncio.ensure_future(probe.shutdown())
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)


async def _connect(p2p: P2P, peer: PeerID, addrs: Sequence[str], timeout: float) -> None:
    """The daemon's CONNECT with a deadline of its own (hivemind's ``connect`` leaves the daemon's 60 s)."""
    from hivemind.p2p.p2p_daemon_bindings.utils import raise_if_failed, read_pbmsg_safe, write_pbmsg
    from hivemind.proto import p2pd_pb2

    control = p2p._client.control
    reader, writer = await control.daemon_connector.open_connection()
    try:
        request = p2pd_pb2.Request(type=p2pd_pb2.Request.CONNECT, connect=p2pd_pb2.ConnectRequest(
            peer=peer.to_bytes(), addrs=[maddr_bytes(a) for a in addrs], timeout=max(1, int(timeout))))
        await write_pbmsg(writer, request)
        response = p2pd_pb2.Response()
        await read_pbmsg_safe(reader, response)
        raise_if_failed(response)
    finally:
        writer.close()


_P2P, _CIRCUIT = 421, 290  # multiaddr protocol codes


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def maddr_bytes(maddr: str) -> bytes:
    """The binary multiaddr the daemon reads. hivemind's ``Multiaddr`` writes a /p2p/ id as a CID, which the
    daemon cannot parse in a relayed address (``/p2p/RELAY/p2p-circuit``); here it is the bare multihash."""
    from hivemind.utils.multiaddr import Multiaddr

    parts, out, i = _parts(maddr), bytearray(), 0
    while i < len(parts):
        if parts[i] == "p2p-circuit":
            out += _varint(_CIRCUIT)
            i += 1
        elif parts[i] == "p2p" and i + 1 < len(parts):
            digest = PeerID.from_base58(parts[i + 1]).to_bytes()
            out += _varint(_P2P) + _varint(len(digest)) + digest
            i += 2
        else:
            j = i + 1
            while j < len(parts) and parts[j] not in ("p2p", "p2p-circuit"):
                j += 1
            out += Multiaddr("/" + "/".join(parts[i:j])).to_bytes()
            i = j
    return bytes(out)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[-1].strip(" *") if str(e).strip() else type(e).__name__
    return text[-200:]


# ---- the asker's side ------------------------------------------------------------------------------------------

@dataclass
class Reachability:
    """What the helpers answered, and the verdicts."""

    addrs: tuple[str, ...]
    answers: list[CheckAnswer] = field(default_factory=list)
    unanswered: list[str] = field(default_factory=list)  # helpers that did not answer (why)

    @property
    def direct(self) -> bool | None:
        """Reachable directly (at least half the answers say so), not reachable, or None: nobody could check."""
        dials = [a.direct for a in self.answers if a.direct is not None]
        if not dials:
            return None
        ok = sum(d.ok for d in dials)
        return ok > 0 and 2 * ok >= len(dials)

    @property
    def relayed(self) -> bool | None:
        dials = [a.relayed for a in self.answers if a.relayed is not None]
        return None if not dials else any(d.ok for d in dials)

    @property
    def observed_ips(self) -> list[str]:
        return sorted({ip for a in self.answers if (ip := host_of(a.observed))})

    def describe(self) -> str:
        """One line per helper: what it did and saw."""
        lines = []
        for a in self.answers:
            if a.refused:
                lines.append(f"{a.helper}: did not check ({a.refused})")
                continue
            parts = [f"sees you at {a.observed}"]
            if a.direct is not None:
                parts.append(f"dialled {a.direct.addr} directly" if a.direct.ok
                             else f"could not dial you directly ({a.direct.error})")
            parts += [f"skipped {addr}: {why}" for addr, why in a.skipped]
            if a.relayed is not None:
                parts.append("dialled you through itself (a relay)" if a.relayed.ok
                             else f"could not dial you through itself ({a.relayed.error})")
            lines.append(f"{a.helper}: " + "; ".join(parts))
        lines += [f"{h}: no answer" for h in self.unanswered]
        return "\n  ".join(lines)


async def ask(p2p: P2P, helper: PeerID, request: CheckRequest, timeout: float = ASK_TIMEOUT) -> CheckAnswer:
    """One helper's answer to ``request`` (raises on no answer)."""
    async def run() -> CheckAnswer:
        _, reader, writer = await p2p.call_binary_stream_handler(helper, HANDLE)
        try:
            await _send(writer, request.to_bytes())
            return CheckAnswer.from_bytes(await _receive(reader, timeout), helper.to_base58())
        finally:
            writer.close()

    return await asyncio.wait_for(run(), timeout)


async def check_reachability(p2p: P2P, helpers: Sequence[str], addrs: Sequence[str], *, relayed: bool = False,
                             timeout: float = ASK_TIMEOUT) -> Reachability:
    """Ask up to :data:`MAX_HELPERS` of ``helpers`` (peer ids) at once to dial us back at ``addrs``."""
    own = p2p.peer_id.to_base58()
    chosen = [h for h in dict.fromkeys(helpers) if h != own][:MAX_HELPERS]
    request = CheckRequest(tuple(addrs), relayed)
    results = await asyncio.gather(*(ask(p2p, PeerID.from_base58(h), request, timeout) for h in chosen),
                                   return_exceptions=True)
    report = Reachability(tuple(addrs))
    for helper, result in zip(chosen, results, strict=True):
        if isinstance(result, CheckAnswer):
            report.answers.append(result)
        else:
            logger.debug("reachability helper %s did not answer: %r", helper, result)
            report.unanswered.append(helper)
    return report


def peer_ids_of(maddrs: Sequence[str]) -> list[str]:
    """The peer ids at the end of full multiaddrs (``.../p2p/ID``), in order, without repeats."""
    found = []
    for maddr in maddrs:
        parts = _parts(maddr)
        if "p2p" in parts and parts.index("p2p") + 1 < len(parts) and not is_relayed(maddr):
            found.append(parts[parts.index("p2p") + 1])
    return list(dict.fromkeys(found))


def unreachable_message(report: Reachability) -> str:
    """What a peer that nobody can dial, with relays off, should do (the text of its refusal)."""
    ips = report.observed_ips
    public = ips[0] if len(ips) == 1 else "YOUR_PUBLIC_IP"
    seen = f" (the swarm sees this machine at {', '.join(ips)})" if ips else ""
    return (
        f"this peer is not reachable: the peers it asked could not dial it back at {' '.join(report.addrs)}, so "
        f"clients could not connect to it either; it does not join the swarm.\n  {report.describe()}\n"
        f"Do one of:\n"
        f"  1. serve through a relay: drop --no_relay / --no_auto_relay (both are on by default for `swarm peer`; "
        f"the bootstrap peers relay for you, or name relays with --relays MADDR ...);\n"
        f"  2. forward a TCP port on your router to this machine and announce it: --host_maddrs "
        f"/ip4/0.0.0.0/tcp/PORT --announce_maddrs /ip4/{public}/tcp/PORT{seen};\n"
        f"  3. if it is reachable in a way this check cannot see (another route, a different outbound IP), skip "
        f"the check: --force_reachability public"
    )
