#!/usr/bin/env python3
"""The official OpenAI Python client through headroom, beside the same client straight to the replica.

Most production traffic reaches vLLM through `openai` (or a framework built on it), so what that
client sees through the proxy is checked against what it sees without it, call by call:

  | check                | through headroom, compared with direct                                   |
  |----------------------|--------------------------------------------------------------------------|
  | models               | the same model ids                                                       |
  | chat, completions    | the same finish_reason and token counts, streamed and whole, and for a   |
  |                      | chat message with an inline image, and an agent's turn with tools        |
  | usage                | a stream that did not ask for usage gets none; one that asked gets it    |
  | errors               | the same exception class, status and message (unknown model, too long)   |
  | unknown route        | NotFoundError in the OpenAI error shape, from the proxy                  |
  | concurrency          | N async streams at once, every one complete                              |
  | early close          | the client closing a stream mid-way frees the replica and the proxy      |
  | node client          | the official Node client (undici's HTTP/1.1): the same calls, as direct;  |
  |                      | N streams at once, every other one aborted mid-way, none left running    |
  | rate limit           | 429 with Retry-After; the client's own retry honours it and succeeds     |
  | queue full, deadline | RateLimitError (429) and InternalServerError (503), each with Retry-After |
  | request id           | the client reads each answer's id (`_request_id`): its own, or the proxy's |
  | capture              | the client's requests are in the capture, by the ids it read; its prompt |
  |                      | text is not                                                               |

The replica is `headroom sim` with fixed step times; two proxies stand in front of it: one with
client API keys (one of them rate-limited) and the capture on, one with an admission cap of a
single request for the refusals. Exit status 1 when any check fails, with what differed.

    python3 scripts/check_clients.py --headroom target/debug/headroom [--streams 64] [--node off]

The Node client is installed by `make clients` (`npm ci` in scripts/clients-node).
"""

import argparse
import asyncio
import json
import os
import pathlib
import re
import subprocess
import sys
import signal
import tempfile
import threading
import time
import urllib.request

import openai

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CANARY = "canary-7f3a9c1e-never-in-a-capture"
KEY, LIMITED_KEY = "sk-client-check-main", "sk-client-check-limited"
WAIT_S = 30.0
# Request ids the client read from answers, to be found in the capture.
REQUEST_IDS = []


class Process:
    """A headroom process whose first stdout line is its URL; stderr goes to a log file."""

    def __init__(self, argv, log, env=None):
        self.log = log
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),
            text=True,
            env={**os.environ, **(env or {})},
        )
        # The first line, or none within WAIT_S (a process stuck before it listens).
        first = []
        reader = threading.Thread(target=lambda: first.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(WAIT_S)
        line = first[0].strip() if first else ""
        if not line.startswith("http://"):
            self.stop()
            raise SystemExit(f"{argv[1]} did not start ({log}):\n{pathlib.Path(log).read_text()[-2000:]}")
        self.url = line

    def admin(self):
        """The admin URL a `headroom serve` names on stderr once it listens."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            m = re.search(r"admin (http://[0-9.:]+)", pathlib.Path(self.log).read_text())
            if m:
                return m.group(1)
            time.sleep(0.05)
        raise SystemExit(f"no admin address in {self.log}")

    def stop(self):
        # The proxies' configs set no drain and a 5 s grace, so SIGTERM ends them within seconds.
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def metric(text, name, **labels):
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name)] not in "{ ":
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def eventually(what, probe, timeout=10.0):
    """Polls `probe` until it returns true; fails the check with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        if probe():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.05)


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def chat_args(**extra):
    return dict(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": f"Say hello. {CANARY}"},
        ],
        max_tokens=12,
        extra_body={"ignore_eos": True},
        **extra,
    )


def completion_args(**extra):
    return dict(model=MODEL, prompt=f"Once upon a time {CANARY}", max_tokens=9, extra_body={"ignore_eos": True}, **extra)


def stream_shape(chunks):
    """What a stream says, free of ids and text: its content-bearing chunks, finish reasons and usage."""
    content = sum(
        1
        for c in chunks
        for ch in c.choices
        if (getattr(ch, "delta", None) and ch.delta.content) or getattr(ch, "text", None)
    )
    finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    usage = [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in chunks if c.usage]
    return {"content_chunks": content, "finish": finish, "usage": usage, "last_has_choices": bool(chunks[-1].choices)}


def same(name, direct, proxied):
    expect(direct == proxied, f"{name}: direct {direct!r}, through headroom {proxied!r}")
    return proxied


def check_calls(direct, proxy):
    """The calls a client makes, each compared with the same call straight to the replica."""
    out = {}
    out["models"] = same("models", [m.id for m in direct.models.list()], [m.id for m in proxy.models.list()])

    def whole_chat(c):
        r = c.chat.completions.create(**chat_args())
        return r.choices[0].finish_reason, r.choices[0].message.role, r.usage.prompt_tokens, r.usage.completion_tokens

    out["chat"] = same("chat", whole_chat(direct), whole_chat(proxy))
    expect(out["chat"][3] == 12, f"chat: {out['chat'][3]} completion tokens, asked for 12")

    # A vision request: the image travels inline (base64), and the proxy's inspection reads past it.
    pixel = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="

    def vision(c):
        args = chat_args()
        args["messages"][-1]["content"] = [
            {"type": "text", "text": f"What is in this image? {CANARY}"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{pixel}"}},
        ]
        r = c.chat.completions.create(**args)
        return r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens

    out["chat with an image"] = same("chat with an image", vision(direct), vision(proxy))

    # An agent's turn: tool definitions, and a history with a tool call and its result.
    def agent(c):
        args = chat_args()
        args["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "The weather in a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ]
        args["messages"] += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 4 degrees"},
        ]
        r = c.chat.completions.create(**args)
        return r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens

    out["chat with tools and a tool call"] = same("chat with tools and a tool call", agent(direct), agent(proxy))

    for usage in (False, True):
        extra = {"stream_options": {"include_usage": True}} if usage else {}
        d = stream_shape(list(direct.chat.completions.create(**chat_args(stream=True, **extra))))
        p = stream_shape(list(proxy.chat.completions.create(**chat_args(stream=True, **extra))))
        name = f"chat stream, usage {'asked' if usage else 'not asked'}"
        out[name] = same(name, d, p)
        expect(p["finish"] == ["length"] and p["content_chunks"] == 12, f"{name}: {p}")
        # The proxy asks the engine for usage either way; a client that did not ask must not see it.
        expect(bool(p["usage"]) == usage, f"{name}: usage {p['usage']}")

    def whole_completion(c):
        r = c.completions.create(**completion_args())
        return r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens

    out["completion"] = same("completion", whole_completion(direct), whole_completion(proxy))
    d = stream_shape(list(direct.completions.create(**completion_args(stream=True))))
    p = stream_shape(list(proxy.completions.create(**completion_args(stream=True))))
    out["completion stream"] = same("completion stream", d, p)
    expect(p["content_chunks"] == 9 and not p["usage"], f"completion stream: {p}")

    def error(c, **kw):
        try:
            c.chat.completions.create(**{**chat_args(), **kw})
        except openai.APIStatusError as e:
            return type(e).__name__, e.status_code, e.message
        raise AssertionError(f"{kw}: no error")

    out["unknown model"] = same("unknown model", error(direct, model="no-such-model"), error(proxy, model="no-such-model"))
    out["max_tokens too large"] = same(
        "max_tokens too large", error(direct, max_tokens=10**7), error(proxy, max_tokens=10**7)
    )
    try:
        proxy.embeddings.create(model=MODEL, input="x")
        raise AssertionError("embeddings: answered through headroom, which does not serve the route")
    except openai.NotFoundError as e:
        expect(isinstance(e.body, dict) and "/v1/embeddings" in e.body.get("message", ""), f"embeddings: {e.body}")
        out["unknown route"] = (type(e).__name__, e.status_code, e.message)

    raw = proxy.chat.completions.with_raw_response.create(**chat_args())
    expect(raw.headers.get("x-headroom-backend"), f"no x-headroom-backend in {dict(raw.headers)}")
    # The client reads the request's id from the answer (`_request_id`, from x-request-id): the
    # proxy's, which its capture and access log name, or the client's own when it sent one.
    made = proxy.chat.completions.create(**chat_args())._request_id
    own = proxy.chat.completions.create(**chat_args(), extra_headers={"x-request-id": "client-check-1"})._request_id
    expect(made and own == "client-check-1", f"request ids read by the client: {made!r}, {own!r}")
    out["request id"] = f"{made} (made by the proxy), {own} (the client's)"
    REQUEST_IDS.extend([made, own])
    return out


async def check_concurrency(base, n):
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)

    async def one(i):
        args = chat_args(stream=True)
        args["messages"][-1]["content"] += f" {i}"
        return stream_shape([c async for c in await client.chat.completions.create(**args)])

    shapes = await asyncio.gather(*(one(i) for i in range(n)))
    await client.close()
    bad = [s for s in shapes if s["finish"] != ["length"] or s["content_chunks"] != 12]
    expect(not bad, f"{len(bad)} of {n} streams incomplete, e.g. {bad[:1]}")
    return f"{n} streams, each 12 tokens and finish_reason length"


def expect_aborts_settled(replica_url, admin, aborts_before, aborted, who):
    """After `who` aborted `aborted` streams: nothing left running on the replica or the proxy,
    and each abort counted."""
    eventually(
        f"the replica's running requests back to 0 after {who}",
        lambda: metric(get(replica_url + "/metrics"), "vllm:num_requests_running") == 0,
        timeout=5,
    )
    eventually("headroom_open_requests back to 0", lambda: metric(get(admin + "/metrics"), "headroom_open_requests") == 0)
    after = metric(get(admin + "/metrics"), "headroom_client_aborts_total")
    expect(after == aborts_before + aborted, f"headroom_client_aborts_total {aborts_before} -> {after}, {aborted} aborted")


def check_early_close(proxy, replica_url, admin):
    aborts = metric(get(admin + "/metrics"), "headroom_client_aborts_total")
    stream = proxy.chat.completions.create(**{**chat_args(stream=True), "max_tokens": 3000})
    for _, _ in zip(range(3), stream):
        pass
    eventually("the replica running the stream", lambda: metric(get(replica_url + "/metrics"), "vllm:num_requests_running") >= 1)
    stream.close()
    # 3,000 tokens at 5 ms would keep the replica busy 15 s more if the upstream request lived on.
    expect_aborts_settled(replica_url, admin, aborts, 1, "the client closed its stream")
    return "closed after 3 chunks: the replica and the proxy back to 0 requests, one client abort counted"


def check_node(node_dir, streams, direct_url, proxy_url, admin):
    """The official Node client (its own HTTP stack, undici's fetch): the same calls direct and
    through headroom, then `streams` streams at once, every other one aborted by the client."""
    script = node_dir / "check.mjs"
    expect((node_dir / "node_modules" / "openai").is_dir(), f"no openai package in {node_dir}: run `make clients` (npm ci there)")
    aborts = metric(get(admin + "/metrics"), "headroom_client_aborts_total")

    def run(url):
        r = subprocess.run(["node", str(script), url, KEY, str(streams), CANARY], capture_output=True, text=True, timeout=120)
        expect(r.returncode == 0, f"node {script} {url}: exit {r.returncode}\n{r.stderr[-2000:]}")
        return json.loads(r.stdout)

    d, p = run(direct_url), run(proxy_url)
    for key in d:
        same(f"node: {key}", d[key], p.get(key))
    expect(p["chat stream, usage not asked"]["usage"] == [], f"node: usage not asked but received: {p}")
    expect(p["concurrent"] == {"complete": streams - streams // 2, "aborted": streams // 2}, f"node: {p['concurrent']}")
    expect_aborts_settled(direct_url, admin, aborts, streams // 2, "the Node client's aborts")
    version = json.loads((node_dir / "node_modules" / "openai" / "package.json").read_text())["version"]
    return (
        f"openai {version} on Node {subprocess.run(['node', '--version'], capture_output=True, text=True).stdout.strip()}: "
        f"every call as direct; {streams} streams, {streams // 2} aborted after three chunks and counted, none left running"
    )


def check_rate_limit(base, admin):
    no_retry = openai.OpenAI(base_url=base + "/v1", api_key=LIMITED_KEY, max_retries=0, timeout=30)
    no_retry.completions.create(**completion_args())  # spends the burst of 1
    try:
        no_retry.completions.create(**completion_args())
        raise AssertionError("a second request within the rate was not refused")
    except openai.RateLimitError as e:
        retry_after = e.response.headers.get("retry-after")
        expect(retry_after and int(retry_after) >= 1, f"429 without a usable Retry-After: {dict(e.response.headers)}")
    # The client's default retries: it must wait what Retry-After says (2 s, or 1 s after a slow
    # first request) and then succeed. Its own backoff (0.5 s, then 1 s, at most) would spend both
    # retries before the key's next request is allowed, about 2 s after the first, and fail.
    time.sleep(2.1)
    retrying = openai.OpenAI(base_url=base + "/v1", api_key=LIMITED_KEY, max_retries=2, timeout=30)
    retrying.completions.create(**completion_args())
    t0 = time.monotonic()
    r = retrying.completions.create(**completion_args())
    waited = time.monotonic() - t0
    expect(r.choices[0].finish_reason == "length", f"retried request: {r}")
    expect(waited >= 0.9, f"the retried request took {waited:.2f} s: the client did not wait for Retry-After")
    limited = metric(get(admin + "/metrics"), "headroom_key_requests_total", key="limited", outcome="rate_limited")
    expect(limited >= 2, f"headroom_key_requests_total rate_limited = {limited}")
    return f"429 with Retry-After {retry_after}; the retrying client waited {waited:.2f} s and succeeded"


def check_refusals(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
    holder = client.chat.completions.create(**{**chat_args(stream=True), "max_tokens": 3000})
    next(iter(holder))  # the single slot is taken
    out = []
    try:
        for cls, error, status in (("full", openai.RateLimitError, 429), ("brief", openai.InternalServerError, 503)):
            try:
                client.chat.completions.create(**chat_args(), extra_headers={"x-headroom-class": cls})
                raise AssertionError(f"class {cls}: admitted past a full replica")
            except openai.APIStatusError as e:
                expect(isinstance(e, error) and e.status_code == status, f"class {cls}: {type(e).__name__} {e.status_code}")
                expect(e.response.headers.get("retry-after"), f"class {cls}: no Retry-After")
                out.append(f"{type(e).__name__} {status} Retry-After {e.response.headers['retry-after']}")
    finally:
        holder.close()
    return "; ".join(out)


def check_capture(path, served, gone):
    text = pathlib.Path(path).read_text()
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    expect(len(records) == served, f"{len(records)} capture records for {served} requests served")
    closed = sum(1 for r in records if r["status"] == 499)
    expect(closed == gone, f"{closed} records of a client gone (499), expected {gone}")
    expect(CANARY not in text, "the prompt's canary string is in the capture")
    ids = {r.get("request_id") for r in records}
    missing = [i for i in REQUEST_IDS if i not in ids]
    expect(not missing, f"request ids the client read but the capture does not name: {missing}")
    return (
        f"{len(records)} records for {served} requests served ({gone} of clients gone, 499), "
        f"the ids the client read among them, no prompt text"
    )


def main():
    # A CI timeout's SIGTERM unwinds like Ctrl-C, so the processes started here are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--headroom", default="target/debug/headroom", help="the headroom binary")
    ap.add_argument("--streams", type=int, default=64, help="concurrent streams for the concurrency check")
    ap.add_argument(
        "--node",
        default=str(pathlib.Path(__file__).resolve().parent / "clients-node"),
        help="directory of check.mjs with the Node client installed (npm ci); 'off' skips the Node client",
    )
    ap.add_argument("--out", help="directory for the logs and the capture (default: a temporary one)")
    args = ap.parse_args()
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="headroom-clients-"))
    out.mkdir(parents=True, exist_ok=True)
    bin = str(pathlib.Path(args.headroom).resolve())

    started = []
    try:
        sim = Process(
            [bin, "sim", "--port", "0", "--latency-model", "constant", "--time-to-first-token", "10",
             "--inter-token-latency", "5", "--max-num-seqs", "512"],
            out / "sim.log",
        )
        started.append(sim)
        capture = out / "capture.jsonl"
        capture.unlink(missing_ok=True)  # the capture appends; a rerun into the same directory starts afresh
        (out / "open.toml").write_text(
            f'listen = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n[[backends]]\nurl = "{sim.url}"\n'
            f'[capture]\npath = "{capture}"\n'
            "[shutdown]\ndrain_ms = 0\ngrace_ms = 5000\n"
            '[[security.api_keys]]\nname = "main"\nenv = "CHECK_KEY_MAIN"\n'
            '[[security.api_keys]]\nname = "limited"\nenv = "CHECK_KEY_LIMITED"\nrate_per_s = 0.5\nburst = 1\n'
        )
        (out / "tight.toml").write_text(
            f'listen = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n[[backends]]\nurl = "{sim.url}"\n'
            "[shutdown]\ndrain_ms = 0\ngrace_ms = 5000\n"
            "[admission]\nmax_in_flight = 1\nmax_cap = 1\n"
            "[classes.default]\n[classes.full]\nmax_queue = 0\n[classes.brief]\nqueue_timeout_ms = 300\n"
        )
        keys = {"CHECK_KEY_MAIN": KEY, "CHECK_KEY_LIMITED": LIMITED_KEY}
        proxy = Process([bin, "serve", "--config", str(out / "open.toml")], out / "open.log", env=keys)
        started.append(proxy)
        tight = Process([bin, "serve", "--config", str(out / "tight.toml")], out / "tight.log")
        started.append(tight)
        admin = proxy.admin()
        for p in (proxy, tight):
            eventually(f"{p.url}/readyz", lambda: _ready(p.admin()), timeout=WAIT_S)

        direct = openai.OpenAI(base_url=sim.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        through = openai.OpenAI(base_url=proxy.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        failures = 0
        results = []
        checks = [
            ("calls", lambda: check_calls(direct, through)),
            ("concurrency", lambda: asyncio.run(check_concurrency(proxy.url, args.streams))),
            ("early close", lambda: check_early_close(through, sim.url, admin)),
            *(
                []
                if args.node == "off"
                else [("node client", lambda: check_node(pathlib.Path(args.node), args.streams, sim.url, proxy.url, admin))]
            ),
            ("rate limit", lambda: check_rate_limit(proxy.url, admin)),
            ("queue full, deadline", lambda: check_refusals(tight.url)),
        ]
        for name, run in checks:
            try:
                detail = run()
                results.append((name, "ok", detail))
            except Exception as e:  # noqa: BLE001 - every check reports, whatever went wrong in it
                failures += 1
                results.append((name, "FAILED", f"{type(e).__name__}: {e}"))
        # Every generation request is captured, the failed and the closed ones included, except
        # those the proxy refused before reading their body (here the rate-limited key's 429s).
        metrics = get(admin + "/metrics")
        served = sum(
            metric(metrics, "headroom_requests_total", route=r) - metric(metrics, "headroom_requests_total", route=r, backend="none")
            for r in ("chat", "completions")
        )
        proxy.stop()  # flushes the capture
        started.remove(proxy)
        try:
            gone = 1 + (0 if args.node == "off" else args.streams // 2)
            results.append(("capture", "ok", check_capture(capture, int(served), gone)))
        except AssertionError as e:
            failures += 1
            results.append(("capture", "FAILED", str(e)))
    finally:
        for p in started:
            p.stop()

    print(f"openai {openai.__version__} through headroom, against the same client direct ({out})")
    for name, status, detail in results:
        if isinstance(detail, dict):
            print(f"  {status:6} {name}")
            for k, v in detail.items():
                print(f"           {k}: {v}")
        else:
            print(f"  {status:6} {name}: {detail}")
    sys.exit(1 if failures else 0)


def _ready(admin):
    try:
        get(admin + "/readyz")
        return True
    except OSError:
        return False


if __name__ == "__main__":
    main()
