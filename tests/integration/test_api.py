"""``swarm api`` and ``swarm chat`` against a real swarm of 2 peers, driven by the official ``openai`` client.

The API's greedy output (temperature 0) equals ``swarm generate``'s, streamed or not, as completions and as chat
(the tiny model has no chat template: the fallback ``User: ...\\nAssistant:`` prompt); 16 concurrent streams all
complete with the right text; bad requests get OpenAI-style errors and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import openai
import pytest
import torch

from peers.client.textgen import eos_ids, load_tokenizer

KEY = "test-key"
MODEL = "llama-tiny"
QUESTION = "Hello swarm"
PROMPT = f"User: {QUESTION}\nAssistant:"  # the chat fallback's prompt for [{"role": "user", "content": QUESTION}]
NEW = 24


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "peers.cli", *args]


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line of ``proc``'s stdout, or fail with its stderr."""
    deadline, data = time.monotonic() + timeout, b""
    while b"\n" not in data:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(proc.stdout.fileno(), 4096) if ready else b""
        if not chunk:
            proc.kill()
            raise RuntimeError(f"`swarm api` printed no URL (code {proc.wait()}):\n{proc.stderr.read().decode()}")
        data += chunk
    return data.decode()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def served(llama_swarm, llama_dir) -> Iterator[tuple[str, str, str]]:
    """The API's base URL, what ``swarm generate`` prints for ``PROMPT`` (run while the API starts), and the API's
    metrics URL."""
    api = subprocess.Popen(cli("api", str(llama_dir), "--initial_peers", *llama_swarm.initial_peers, "--port", "0",
                               "--metrics_port", "0"),
                           env={**os.environ, "SWARM_API_KEY": KEY},  # the key as --api_key KEY, out of `ps`
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        generated = subprocess.run(cli("generate", str(llama_dir), "--initial_peers", *llama_swarm.initial_peers,
                                       "--prompt", PROMPT, "--max_new_tokens", str(NEW)),
                                   capture_output=True, text=True, timeout=120)
        assert generated.returncode == 0, generated.stderr
        assert generated.stdout.startswith(PROMPT) and generated.stdout.endswith("\n")
        assert generated.stdout[len(PROMPT):-1].strip(), "swarm generate added no text: every comparison would pass"
        printed = read_line(api, 120)
        while "/metrics" not in printed:  # the metrics line comes right after the API's
            printed += read_line(api, 30)
        url, metrics = (re.search(rf"(http://\S+/{end})", printed).group(1) for end in ("v1", "metrics"))
        yield url, generated.stdout[len(PROMPT):-1], metrics
    finally:
        stop(api)


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0], api_key=KEY, max_retries=0, timeout=60)


def same_text(api_text: str, generated: str) -> bool:
    """``swarm generate`` holds back an incomplete character at the very end; the API sends it as U+FFFD."""
    return api_text.rstrip("\ufffd") == generated.rstrip("\ufffd")


def test_models_lists_the_swarms_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completions_equal_swarm_generate(client, served, llama_dir):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0)
    assert same_text(whole.choices[0].text, served[1])
    usage = whole.usage
    assert usage.prompt_tokens == len(load_tokenizer(llama_dir).encode(PROMPT).ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    finish = whole.choices[0].finish_reason
    assert finish == "stop" if usage.completion_tokens < NEW else finish == "length"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_equals_swarm_generate_on_the_fallback_prompt(client, served):
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0)
    assert whole.choices[0].message.role == "assistant" and same_text(whole.choices[0].message.content, served[1])
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_a_stop_sequence_across_tokens_ends_the_text(client, served):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0).choices[0].text
    stop = full[3:5]  # two characters, so two tokens of the byte tokenizer at least
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0, stop=[stop, "NEVER"])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_sampling_with_a_seed_is_reproducible(client):
    def sample() -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.5, top_p=0.95,
                                         seed=7).choices[0].text

    assert sample() == sample()


def expected_texts(swarm_client, llama_dir, prompts: list[str], new: int) -> list[str]:
    """Greedy continuations from the Python client (its own sessions, 8 rows each), cut at the end token."""
    tokenizer = load_tokenizer(llama_dir)
    stops, texts = set(eos_ids(llama_dir, tokenizer)), []
    ids = torch.tensor([tokenizer.encode(p).ids for p in prompts])
    for rows in ids.split(8):  # the peers' --max_batch_size
        for out in swarm_client.generate(rows, new)[:, ids.shape[1]:].tolist():
            end = next((i for i, t in enumerate(out) if t in stops), len(out))
            texts.append(tokenizer.decode(out[:end]))
    return texts


def test_16_concurrent_streams_all_complete(served, llama_client, llama_dir):
    prompts = [f"Prompt {i:02d}:" for i in range(16)]  # one length: two batches of 8 rows for the expected

    async def one(api: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=served[0], api_key=KEY, max_retries=0, timeout=120) as api:
            return await asyncio.gather(*(one(api, p) for p in prompts))

    got = asyncio.run(run_all())
    assert got == expected_texts(llama_client, llama_dir, prompts, 8)


@pytest.mark.parametrize("kwargs, error, code", [
    (dict(model="no-such-model"), openai.NotFoundError, "model_not_found"),
    (dict(prompt="x" * 600), openai.BadRequestError, "context_length_exceeded"),
    (dict(max_tokens=500), openai.BadRequestError, "context_length_exceeded"),
    (dict(temperature=-1), openai.BadRequestError, "invalid_value"),
    (dict(max_tokens=0), openai.BadRequestError, "invalid_value"),
    (dict(n=2), openai.BadRequestError, "unsupported_parameter"),
    (dict(stream=True, prompt="x" * 600), openai.BadRequestError, "context_length_exceeded"),
])
def test_bad_requests_get_openai_errors(client, kwargs, error, code):
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0) | kwargs
    with pytest.raises(error) as info:
        client.completions.create(**request)
    assert info.value.body["code"] == code and info.value.body["message"]
    assert {"message", "type", "param", "code"} <= set(info.value.body)


def post(url: str, data: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    import json

    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_malformed_json_and_keys_are_refused_and_the_server_keeps_serving(served, client):
    url = served[0] + "/completions"
    status, body = post(url, b'{"model": "llama-tiny", "prompt": ', {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and body["error"]["code"] == "invalid_json"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, body = post(url, b"{}", headers)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served[0], api_key="wrong", max_retries=0).models.list()
    status, body = post(served[0] + "/nowhere", b"{}", {"Authorization": f"Bearer {KEY}"})
    assert status == 404 and body["error"]["code"] == "not_found"
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_chat_cli_through_a_pipe(llama_swarm, llama_dir, client):
    """Ctrl-C stops a reply (not the program), /reset forgets, the history shapes the next reply, /exit quits."""
    chat = subprocess.Popen(cli("chat", str(llama_dir), "--initial_peers", *llama_swarm.initial_peers,
                                "--temperature", "0", "--max_tokens", "32"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        chat.stdin.write(f"{QUESTION}\n".encode())
        chat.stdin.flush()
        first = read_line_start(chat)  # the reply has started streaming
        chat.send_signal(signal.SIGINT)
        chat.stdin.write(f"/reset\n{QUESTION}\nsecond\n/exit\n".encode())
        chat.stdin.flush()
        out, err = chat.communicate(timeout=120)
    finally:
        stop(chat)
    assert chat.returncode == 0, err.decode()
    text = (first + out).decode()
    stopped, _, rest = text.partition(" [stopped]\n")
    assert rest, f"the first reply was not stopped: {text!r}\n{err.decode()}"

    def reply(messages: list[dict[str, str]]) -> str:
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32,
                                              temperature=0).choices[0].message.content

    one = reply([{"role": "user", "content": QUESTION}])
    two = reply([{"role": "user", "content": QUESTION}, {"role": "assistant", "content": one},
                 {"role": "user", "content": "second"}])
    assert one.startswith(stopped) and len(stopped) < len(one)
    assert rest == f"{one}\n{two}\n"


def read_line_start(proc: subprocess.Popen, timeout: float = 120) -> bytes:
    """Some bytes of ``proc``'s stdout, as soon as there are any."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the chat printed nothing"
    return os.read(proc.stdout.fileno(), 1)


def test_a_caller_that_goes_away_frees_its_session_on_the_peers(client, llama_client):
    def open_sessions() -> list[int]:
        return [llama_client.info(r.peer_id).sessions for r in llama_client.records()]

    # sessions that earlier callers left detached expire after the peers' 60 s timeout: start from none
    _wait_until(lambda: not any(open_sessions()), 90, "sessions of earlier tests stayed open")
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0, stream=True)
    next(iter(stream))
    assert any(open_sessions()), "the stream has no session on the peers"
    stream.close()
    # far less than the peers' 60 s session timeout: the session was closed, not left to expire
    _wait_until(lambda: not any(open_sessions()), 20, "the session stayed open after its caller went away")
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert again.usage.completion_tokens >= 1


def _wait_until(condition, seconds: float, failure: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.2)


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines)
            if name and not name.startswith("#")}


def test_metrics_count_requests_statuses_and_tokens(client, served):
    """``--metrics_port``: one completion and one refused request move exactly their counters."""
    ok = 'fusionswarm_api_requests_total{route="/v1/completions",status="200"}'
    missing = 'fusionswarm_api_requests_total{route="/v1/completions",status="404"}'
    generated = 'fusionswarm_api_tokens_total{kind="completion"}'
    before = _scrape(served[2])
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    after = _scrape(served[2])
    assert after[ok] - before.get(ok, 0) == 1 and after[missing] - before.get(missing, 0) == 1
    assert after[generated] - before.get(generated, 0) == whole.usage.completion_tokens
    assert after["fusionswarm_api_requests_in_flight"] == 0
    assert after['fusionswarm_api_request_seconds_count{route="/v1/completions"}'] >= 2
