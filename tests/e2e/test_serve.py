"""`jaxtrain serve` against the official openai client: a real server subprocess on
127.0.0.1 (a free port) over test_engine.py's tiny chat run: 16 concurrent chat requests,
streamed and whole, sharing the continuous batch; n, logprobs, seeds, stop strings; bad
requests answered 4xx in OpenAI's error shape while the server keeps serving; a key;
Ctrl-C ends it cleanly."""

import concurrent.futures
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from test_engine import chat_run

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

ROOT = pathlib.Path(__file__).resolve().parents[2]
KEY = "test-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(process, url: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"serve exited {process.returncode}: {process.stderr.read()[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    pytest.fail("serve did not come up")


@pytest.fixture(scope="module")
def server(tmp_path_factory, devices):
    """(base url, the run, transformers' tokenizer): serve running on a free port."""
    workdir, theirs = chat_run(tmp_path_factory.mktemp("serve"), devices)
    port = _free_port()
    env = dict(os.environ, JAXTRAIN_API_KEY=KEY)
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxtrain", "serve", f"--workdir={workdir}", f"--port={port}",
         "--slots=4", "--model_name=tiny", "--max_body_bytes=20000"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_until_up(process, f"http://127.0.0.1:{port}/health")
    yield f"http://127.0.0.1:{port}", process
    if process.poll() is None:
        process.kill()
        process.wait()


def _client(server, key: str = KEY):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=key, max_retries=0, timeout=120)


def _chat(client, content: str, stream: bool, **kw):
    messages = [{"role": "user", "content": content}]
    if not stream:
        r = client.chat.completions.create(model="tiny", messages=messages, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                **kw):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_sixteen_concurrent_chats_streamed_and_whole(server):
    client = _client(server)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    contents = [f"Hello {i % 4}" for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: _chat(client, contents[i], i % 2 == 1,
                                                temperature=0, max_tokens=10), range(16)))
    for i, (text, finish) in enumerate(results):
        assert finish in ("stop", "length"), (i, finish)
        # Greedy: the same prompt gives the same reply, streamed or whole, whatever it
        # shared the batch with.
        assert (text, finish) == results[i % 4], i
    assert all(text for text, _ in results)  # replies, not empty strings
    alone = _chat(client, contents[0], False, temperature=0, max_tokens=10)
    assert alone == results[0]


def test_n_logprobs_seeds_and_stops(server):
    client = _client(server)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Name a colour"}],
              max_tokens=6, temperature=1.0, seed=5, n=2, logprobs=True, top_logprobs=2)
    first, again = (client.chat.completions.create(**kw) for _ in range(2))
    assert [c.message.content for c in first.choices] == \
        [c.message.content for c in again.choices]
    for choice in first.choices:
        for item in choice.logprobs.content:
            assert item.logprob <= 0 and len(item.top_logprobs) == 2
            assert item.top_logprobs[0].logprob >= item.logprob - 1e-6
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)
    whole = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8,
                                      temperature=0)
    text = whole.choices[0].text
    assert len(text) > 3
    cut = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8,
                                    temperature=0, stop=[text[2:4]])
    assert cut.choices[0].text == text[:text.find(text[2:4])]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=8, temperature=0, stream=True))
    assert streamed == text


def _raw(server, body: bytes, key: str = KEY):
    request = urllib.request.Request(f"{server[0]}/v1/chat/completions", data=body, headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_requests_are_4xx_and_the_server_keeps_serving(server):
    client = _client(server)
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.NotFoundError, match="model='gpt-4'"):
        client.chat.completions.create(model="gpt-4", messages=messages)
    with pytest.raises(openai.BadRequestError, match="no room|too many"):
        client.chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": "Hello there " * 40}])
    for bad in ({"temperature": 5}, {"n": 0}, {"max_tokens": 10_000}, {"top_logprobs": 99}):
        with pytest.raises(openai.BadRequestError, match=next(iter(bad))):
            client.chat.completions.create(model="tiny", messages=messages, **bad)
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="wrong").models.list()
    status, body = _raw(server, b"{not json")
    assert status == 400 and "not JSON" in body["error"]["message"]
    status, body = _raw(server, json.dumps({"model": "tiny", "messages": [
        {"role": "user", "content": "x" * 30_000}]}).encode())
    assert status == 413 and body["error"]["message"]
    status, body = _raw(server, b'{"model": "tiny", "messages": "hi"}')
    assert status == 400 and body["error"]["param"] == "messages"
    text, finish = _chat(client, "Hello 1", False, temperature=0, max_tokens=4)
    assert finish in ("stop", "length")


def test_a_client_leaving_mid_stream_frees_its_slots(server):
    """Four streams (every slot) dropped after their first chunks: their slots free up, and
    four more requests are answered."""
    client = _client(server)
    for _ in range(4):
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], stream=True,
            max_tokens=40, temperature=1.0, extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda i: _chat(client, "Hello 2", False, temperature=0,
                                             max_tokens=4), range(4)))
    assert len(set(done)) == 1 and done[0][1] in ("stop", "length")


def test_ctrl_c_stops_the_server_cleanly(server):
    process = server[1]
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 0, process.stderr.read()[-2000:]
