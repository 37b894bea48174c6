"""The endpoint over real HTTP (Ray Serve on 127.0.0.1): the official OpenAI client, greedy output
equal to `aerie generate --method none`, OpenAI-shaped errors for bad input while good requests
keep streaming, 429 when the queue is full, disconnects freeing their slots, the metrics on Ray's
Prometheus endpoint, and the captured traffic read back by `aerie ingest`. The tests run in order
and share one deployment (the capture test reads what the earlier ones sent)."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
from openai import OpenAI

from aerie.generate import run_generate

PROMPT = "def read_config(path):"
MESSAGES = [{"role": "user", "content": "Explain what f3(x) returns for x = 3."}]
TOKEN_ID_PROMPT = [5, 17, 42, 99]


def wait_for(check, timeout: float = 30.0, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s (last: {value!r})")
        time.sleep(interval)


@pytest.fixture(scope="module")
def api(endpoint):
    url, config = endpoint
    headers = {"Authorization": f"Bearer {config.api_key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        yield client, config


@pytest.fixture(scope="module")
def client(endpoint) -> OpenAI:
    url, config = endpoint
    return OpenAI(base_url=f"{url}/v1", api_key=config.api_key, max_retries=0)


@pytest.fixture(scope="module")
def model(endpoint) -> str:
    return endpoint[1].resolved().served_model


def stats(api) -> dict:
    return api[0].get("/stats").json()


def test_models_and_health(endpoint, client, model):
    url, _ = endpoint
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}  # no key needed
    assert [m.id for m in client.models.list().data] == [model] == ["tiny-served"]


def test_openai_client_greedy_output_equals_generate(client, model, served_target_dir):
    target = str(served_target_dir)
    [expected] = run_generate(target, [PROMPT], max_tokens=24)
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    assert completion.choices[0].text == expected["text"]
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == len(expected["token_ids"]) == 24
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected["text"]

    [expected_chat] = run_generate(target, [MESSAGES], max_tokens=24)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected_chat["text"]
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_chat["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_seed_and_token_id_prompts(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    stop = next(full[i:i + 3] for i in range(8, len(full) - 3) if full[i:i + 3].strip())
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.find(stop)] and cut.choices[0].finish_reason == "stop"

    def sampled(seed: int) -> str:
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=1.0,
                                         seed=seed).choices[0].text

    assert sampled(7) == sampled(7)
    assert len({sampled(seed) for seed in range(4)}) > 1
    by_ids = client.completions.create(model=model, prompt=TOKEN_ID_PROMPT, max_tokens=8, temperature=0)
    assert by_ids.usage.prompt_tokens == len(TOKEN_ID_PROMPT) and by_ids.usage.completion_tokens == 8


def _stream(api, body: dict, sink: dict) -> None:
    """Read one SSE stream to the end, recording when each chunk arrived."""
    client, _ = api
    with client.stream("POST", "/v1/completions", json=body) as response:
        sink["status"] = response.status_code
        for line in response.iter_lines():
            if line.startswith("data: "):
                sink.setdefault("chunks", []).append((time.monotonic(), line[len("data: "):]))


def _bad_requests(config, model: str) -> list[tuple[str, str, dict | bytes, dict, int, str | None]]:
    """(name, route, body, headers, status, param) of requests the endpoint must refuse."""
    long_prompt = " ".join(["alpha"] * (4 * config.prompt_limit))
    good = {"model": model, "prompt": PROMPT, "max_tokens": 4}
    return [
        ("malformed JSON", "/v1/completions", b'{"model": "x", "prompt": ', {}, 400, None),
        ("not an object", "/v1/completions", b"[1, 2]", {}, 400, None),
        ("max_tokens string", "/v1/completions", {**good, "max_tokens": "5"}, {}, 400, "max_tokens"),
        ("temperature string", "/v1/completions", {**good, "temperature": "hot"}, {}, 400, "temperature"),
        ("messages not a list", "/v1/chat/completions", {"model": model, "messages": "hi"}, {}, 400, "messages"),
        ("negative max_tokens", "/v1/completions", {**good, "max_tokens": -3}, {}, 400, "max_tokens"),
        ("huge max_tokens", "/v1/completions", {**good, "max_tokens": 10**9}, {}, 400, "max_tokens"),
        ("prompt over the limit", "/v1/completions", {**good, "prompt": long_prompt}, {}, 400, "prompt"),
        ("chat over the limit", "/v1/chat/completions",
         {"model": model, "messages": [{"role": "user", "content": long_prompt}]}, {}, 400, "messages"),
        ("unknown model", "/v1/completions", {**good, "model": "gpt-9"}, {}, 404, "model"),
        ("token id out of range", "/v1/completions", {**good, "prompt": [1, 2, 10**6]}, {}, 400, "prompt"),
        ("negative token id", "/v1/completions", {**good, "prompt": [3, -1]}, {}, 400, "prompt"),
        ("n > 1", "/v1/completions", {**good, "n": 2}, {}, 400, "n"),
        ("unknown field", "/v1/completions", {**good, "best_of_n": 3}, {}, 400, "best_of_n"),
        ("image content", "/v1/chat/completions", {"model": model, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, {}, 400,
         "messages[0].content"),
        ("missing key", "/v1/completions", good, {"Authorization": ""}, 401, None),
        ("wrong key", "/v1/completions", good, {"Authorization": "Bearer nope"}, 401, None),
        ("body too large", "/v1/completions", {**good, "prompt": "x" * config.max_request_bytes}, {}, 413, None),
    ]


def test_bad_input_gets_openai_errors_while_good_requests_stream(api, model):
    client, config = api
    sink: dict = {}
    good = threading.Thread(target=_stream, args=(api, {"model": model, "prompt": PROMPT, "max_tokens": 400,
                                                        "temperature": 0, "stream": True}, sink))
    good.start()
    wait_for(lambda: sink.get("chunks"), timeout=30)
    started = time.monotonic()
    for name, route, body, headers, status, param in _bad_requests(config, model):
        if isinstance(body, bytes):
            response = client.post(route, content=body, headers={"Content-Type": "application/json", **headers})
        else:
            response = client.post(route, json=body, headers=headers)
        assert response.status_code == status, (name, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], name
        assert error["param"] == param, (name, error)
    finished = time.monotonic()
    good.join(timeout=60)
    assert sink["status"] == 200
    times = [t for t, _ in sink["chunks"]]
    assert any(started <= t <= finished for t in times), "the good stream paused while bad requests were refused"
    payloads = [json.loads(data) for _, data in sink["chunks"] if data != "[DONE]"]
    assert all("error" not in p for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert sink["chunks"][-1][1] == "[DONE]"


def test_full_queue_gets_429_and_disconnects_free_their_slots(api, model):
    client, config = api
    before = stats(api)
    long = 1800  # seconds of decoding: every request is still running or waiting when the next arrives
    body = {"model": model, "prompt": PROMPT, "max_tokens": long, "temperature": 0, "stream": True}
    streams = []
    for _ in range(config.max_slots + config.max_waiting):
        response = client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
        assert response.status_code == 200
        streams.append(response)
    refused = client.post("/v1/completions", json={**body, "stream": False, "max_tokens": 4})
    assert refused.status_code == 429 and refused.headers["Retry-After"] == str(config.retry_after_s)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    # /stats is the loop's snapshot after its latest step: the last request shows up a step later
    wait_for(lambda: (s := stats(api))["running"] == config.max_slots and s["waiting"] == config.max_waiting,
             timeout=30)
    for index, response in enumerate(streams):  # every client goes away: mid-stream, or still waiting
        if index < config.max_slots:
            next(response.iter_lines())
        response.close()
    idle = wait_for(lambda: (s := stats(api))["running"] == 0 and s["waiting"] == 0 and s, timeout=15)
    generated = idle["decode_tokens"] - before["decode_tokens"]
    assert generated < config.max_slots * long / 4, f"cancelled requests ran on: {generated} tokens"
    after = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 4})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4


def _samples(text: str, name: str) -> str:
    """The export's lines of one metric."""
    return "\n".join(line for line in text.splitlines() if line.startswith(name + "{"))


def _metric(text: str, name: str, **tags: str) -> float:
    """Sum of a metric's samples (over replicas) whose tags include `tags`; 0 when absent."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:{{(.*)}})? ([0-9.eE+-]+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in tags.items()):
            total += float(match.group(2))
    return total


def test_metrics_reach_rays_prometheus_endpoint(api, ray_local):
    _, config = api
    port = ray_local.nodes()[0]["MetricsExportPort"]

    def metric(text: str, name: str, **tags: str) -> float:
        """This application's samples only: other modules' deployments export the same names into
        the same Ray session, and Ray keeps a deleted replica's series."""
        return _metric(text, name, application=config.name, **tags)

    def scrape() -> str | None:
        """The export once it shows the disconnects and the running gauge back at 0 (Ray's agent
        exports a gauge's latest value some seconds late; a slot that never frees times out)."""
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        ready = (
            metric(text, "ray_aerie_requests_total", status="499") >= 8
            and metric(text, "ray_aerie_spec_decode_num_drafts_total") > 0
            and f'application="{config.name}"' in _samples(text, "ray_aerie_num_requests_running")
            and metric(text, "ray_aerie_num_requests_running") == 0
        )
        return text if ready else None

    text = wait_for(scrape, timeout=45, interval=1.0)
    live = stats(api)
    assert metric(text, "ray_aerie_requests_total", status="429") >= 1
    assert metric(text, "ray_aerie_requests_total", status="400") >= 10
    drafts = metric(text, "ray_aerie_spec_decode_num_drafts_total")
    accepted = metric(text, "ray_aerie_spec_decode_num_accepted_tokens_total")
    assert 0 < drafts <= live["spec_decode"]["num_drafts"]
    assert metric(text, "ray_aerie_spec_decode_num_draft_tokens_total") == pytest.approx(3 * drafts)
    assert metric(text, "ray_aerie_spec_decode_num_accepted_tokens_per_pos_total", position="0") <= drafts
    assert accepted <= 3 * drafts
    assert metric(text, "ray_aerie_spec_decode_steps_total", k="3") > 0
    assert metric(text, "ray_aerie_time_to_first_token_seconds_count") > 0
    assert metric(text, "ray_aerie_generation_tokens_total") > 0


def test_captured_traffic_ingests_and_adds_up(api, served_target_dir, tmp_path):
    from aerie import storage
    from aerie.data.ingest_config import IngestConfig
    from pipelines.ingest import run_ingest

    _, config = api
    captured = wait_for(lambda: (c := stats(api)["capture"])["written"] == c["captured"] and c, timeout=30)
    lines = sum(storage.read_text(f).count("\n") for f in storage.list_files(config.capture.uri, (".jsonl",)))
    assert lines == captured["captured"] > 0 and captured["dropped"] == 0
    manifest = run_ingest(IngestConfig(input=config.capture.uri, target=str(served_target_dir),
                                       out=str(tmp_path / "data"), progress=False))
    counts = manifest["counts"]
    assert counts["read"] == lines
    assert counts["parsed"] + counts["quarantined"] + counts["duplicates"] + counts["too_long"] == counts["read"]
    assert counts["quarantined_by_reason"] == {"unsupported_content": 1}  # the token-id prompt
    assert counts["input_only"] >= 1  # the requests whose clients went away: input only
    assert counts["parsed"] > counts["input_only"]
